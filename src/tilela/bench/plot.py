"""`tilela bench --plot`: PNG charts of merged benchmark records (tilela.bench.merge), per op:

  <op>-speedup.png  per case, FLA's and FlashQLA's time over ours (> 1: ours is faster), horizontal bars;
  <op>-latency.png  ms against the total sequence length T, log-log, one panel per group of cases that differ only
                    in T (and have at least two), one line per implementation.

Ours is the op's first implementation (its Bench.impls); FLA and FlashQLA are the implementations whose names start
with "fla". matplotlib is imported only here, when a chart is drawn.
"""

from __future__ import annotations

import importlib
import io
import math
from pathlib import Path
from typing import Any

from . import OPS

LABELS = {"fla": "FLA", "flash_qla": "FlashQLA", "fla_fused": "FLA (fused)", "fla_unfused": "FLA (unfused)"}
VERSION_OF = {"fla": "fla", "flash_qla": "flash_qla", "fla_fused": "fla", "fla_unfused": "fla"}
DPI = 100
COLORS = {"fla": "C2", "flash_qla": "C3", "fla_fused": "C2", "fla_unfused": "C8"}  # ours: C0; the rest: SPARE
SPARE = ("C1", "C4", "C5", "C6", "C7", "C9")


class PlotError(RuntimeError):
    """A chart that cannot be drawn (matplotlib missing); the message is one line."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install matplotlib (or pip install 'tilela[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ours(op: str) -> str:
    return next(iter(importlib.import_module(OPS[op]).BENCH.impls))


def _timed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("ms") is not None]


def _label(impl: str, records: list[dict[str, Any]]) -> str:
    version = next((r.get("versions", {}).get(VERSION_OF[impl]) for r in records if impl in VERSION_OF), None)
    return LABELS.get(impl, impl) + (f" {version}" if version else "")


def _colors(ours: str, impls: list[str]) -> dict[str, str]:
    """A colour per implementation, the same for an implementation in every chart."""
    spare = iter(SPARE)
    return {impl: "C0" if impl == ours else COLORS.get(impl) or next(spare, "C7") for impl in impls}


def _device(records: list[dict[str, Any]]) -> str:
    """The GPUs the records were timed on, for a title: every distinct name (merged files may come from several
    kinds; each case's row is still one run), "GPU" where the records name none."""
    names = dict.fromkeys(r["device"]["name"] for r in records if isinstance(r.get("device"), dict))
    return " and ".join(names) or "GPU"


def sequence_length(params: dict[str, Any]) -> int | None:
    """T of a case: its T, or the sum of its sequence lengths; None when it has neither."""
    if "T" in params:
        return int(params["T"])
    if "lengths" in params:
        return int(sum(params["lengths"]))
    return None


def speedup_chart(op: str, records: list[dict[str, Any]], path: Path) -> Path | None:
    """The speed-up chart, or None when no case has ours and FLA or FlashQLA both timed."""
    ours = _ours(op)
    ms = {(r["case"], r["impl"]): r["ms"] for r in _timed(records)}
    theirs = list(dict.fromkeys(r["impl"] for r in _timed(records) if r["impl"].startswith("fla")))
    cases = [c for c in dict.fromkeys(r["case"] for r in _timed(records))
             if (c, ours) in ms and any((c, impl) in ms for impl in theirs)]
    if not cases:
        return None
    plt = _pyplot()
    colors = _colors(ours, theirs)
    bar = 0.8 / len(theirs)
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.2 * len(cases) * max(1.0, len(theirs) * 0.75)))
    for j, impl in enumerate(theirs):
        rows = [(i, ms[c, impl] / ms[c, ours]) for i, c in enumerate(cases) if (c, impl) in ms]
        y = [i - 0.4 + bar * (j + 0.5) for i, _ in rows]
        ax.barh(y, [ratio for _, ratio in rows], height=bar, label=_label(impl, records), color=colors[impl])
        for yi, (_, ratio) in zip(y, rows):
            ax.text(ratio, yi, f" {ratio:.2f}", va="center", fontsize=6)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(cases)), cases, fontsize=7)
    ax.set_ylim(len(cases) - 0.5, -0.5)
    ax.set_xlabel(f"their time / {ours}'s time  (> 1: {ours} is faster)")
    ax.set_title(f"{op} on {_device(records)}: speed-up of {ours}", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", linewidth=0.3)
    return _save(fig, plt, path)


def latency_chart(op: str, records: list[dict[str, Any]], path: Path) -> Path | None:
    """The latency chart, or None when no group of cases varies T."""
    ours = _ours(op)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in _timed(records):
        params = r.get("params") or {}
        if sequence_length(params) is None:
            continue
        rest = {k: v for k, v in params.items() if k not in ("T", "lengths", "varlen")}
        rest["sequences"] = len(params.get("lengths", [0]))
        groups.setdefault(tuple(sorted((k, str(v)) for k, v in rest.items())), []).append(r)
    groups = {key: rs for key, rs in groups.items() if len({sequence_length(r["params"]) for r in rs}) >= 2}
    if not groups:
        return None
    plt = _pyplot()
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

    # the parameters that tell the groups apart (a record may lack one that later benches added)
    names = dict.fromkeys(k for key in groups for k, _ in key)
    varying = [k for k in names if len({dict(key).get(k) for key in groups}) > 1]
    impls = list(dict.fromkeys(r["impl"] for rs in groups.values() for r in rs))
    colors = _colors(ours, impls)
    ncols = min(4, len(groups))
    nrows = math.ceil(len(groups) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.4 * nrows + 0.8), squeeze=False,
                             layout="constrained")
    for ax, (key, rs) in zip(axes.flat, groups.items()):
        for impl in impls:
            points = sorted((sequence_length(r["params"]), r["ms"]) for r in rs if r["impl"] == impl)
            if points:
                ax.loglog(*zip(*points), marker="o", markersize=3, color=colors[impl], label=_label(impl, records),
                          linewidth=2.0 if impl == ours else 1.0, linestyle="-" if impl.startswith(ours) else "--")
        lengths = sorted({sequence_length(r["params"]) for r in rs})
        ax.xaxis.set_major_locator(FixedLocator(lengths))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in lengths])
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(" ".join(f"{k}={dict(key).get(k)}" for k in varying), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(which="both", linewidth=0.3)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("sequence length T (tokens)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("ms", fontsize=8)
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.suptitle(f"{op} on {_device(records)}: latency against sequence length", fontsize=10)
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    """Write fig as a palette PNG (a chart has few colours: a third of the size of a full-colour one)."""
    from PIL import Image

    if fig.get_layout_engine() is None:
        fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(path, optimize=True)
    return path


def charts(by_op: dict[str, list[dict[str, Any]]], out_dir: Path) -> list[Path]:
    """Write every chart the merged records of each op allow (bench.merged_by_op); the paths written."""
    written = []
    for op, records in by_op.items():
        for chart, name in ((speedup_chart, "speedup"), (latency_chart, "latency")):
            path = chart(op, records, Path(out_dir) / f"{op}-{name}.png")
            if path is not None:
                written.append(path)
    return written
