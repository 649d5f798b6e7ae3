"""Command line (``tilela`` or ``python -m tilela``):

  demo        the main job: GDN forward on a prefill-like input, checked against the float64 reference and timed
  info        versions, the device, TileLang's kernel cache, and the path each op takes here and why
  check       every op on this device against the float64 reference on fresh random inputs: a pass/fail table
  precompile  build the Hopper kernels ahead of time (TileLang and nvcc; no GPU needed)
  bench       the benchmark harness, and tables and charts of its result files (`tilela bench --help`)
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [name.strip() for name in text.split(",") if name.strip()]


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="tilela", description="tilela's command line (also `python -m tilela`)")
    parser.add_argument("--version", action="version", version=f"tilela {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("demo", help="GDN forward on a prefill-like input, checked against the float64 reference and timed")
    sub.add_parser("info", help="versions, device, kernel cache, and the path each op takes here and why")
    check = sub.add_parser("check", help="every op against the float64 reference on fresh inputs: pass/fail table")
    check.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present, else cpu")
    check.add_argument("--quick", action="store_true", help="one dtype per op, small shapes")
    check.add_argument("--seed", type=int, default=None, help="the inputs' seed (default: a fresh one, printed)")
    pre = sub.add_parser("precompile", help="build the Hopper kernels ahead of time (needs TileLang and nvcc)")
    pre.add_argument("--ops", default=None,
                     help="comma-separated ops (gdn, kda, delta_rule, linear_attn, simple_gla, gla, kkt_solve, "
                          "chunk_local_cumsum, or the public op names; default: all)")
    pre.add_argument("--dtypes", default=None, help="comma-separated q/k dtypes: bfloat16, float16 (default: both)")
    pre.add_argument("--head-dims", default=None, help="comma-separated K: 64, 128, 256 (default: all)")
    pre.add_argument("--processes", type=int, default=min(16, os.cpu_count() or 1),
                     help="compile in this many processes (default: the cores, at most 16)")
    pre.add_argument("--list", action="store_true", help="print the kernels it would build, build none")
    sub.add_parser("bench", add_help=False,
                   help="benchmark ours against FLA and FlashQLA (Hopper GPU), or --report / --plot result files")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if sys.stderr.isatty():  # a progress line is shown: TileLang's per-kernel log lines would break it
        os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    if args.command == "demo":
        from . import demo

        result = demo.main()
        return 0 if result["rel_err_o"] < 1e-2 and result["rel_err_state"] < 1e-2 else 1
    if args.command == "info":
        from . import info

        return info.main()
    if args.command == "check":
        import torch

        from . import check

        if args.device == "cuda" and not torch.cuda.is_available():
            return _fail("check", "--device cuda: no CUDA device is visible here")
        return check.main(args.device, args.quick, args.seed)
    if args.command == "precompile":
        return _precompile(args)
    from . import bench

    return bench.main(rest)


def _fail(command: str, message: str) -> int:
    print(f"tilela {command}: error: {message}", file=sys.stderr)
    return 2


def _precompile(args: argparse.Namespace) -> int:
    from . import precompile
    from ._progress import Progress

    problem = precompile.unavailable()
    if problem is not None:
        return _fail("precompile", problem)
    if args.processes < 1:
        return _fail("precompile", f"--processes: expected an int >= 1, got {args.processes}")
    try:
        head_dims = None if args.head_dims is None else [int(k) for k in _names(args.head_dims)]
    except ValueError:
        return _fail("precompile", f"--head-dims: expected comma-separated integers, got {args.head_dims!r}")
    try:
        todo = precompile.select(_names(args.ops), _names(args.dtypes), head_dims)
    except ValueError as exc:
        return _fail("precompile", str(exc))
    if args.list:
        for job in todo:
            print(job.kind, job.config)
        print(f"{len(todo)} kernels")
        return 0
    from tilelang.env import env

    print(f"building {len(todo)} kernels in {args.processes} processes into {env.TILELANG_CACHE_DIR}")
    start, failed = time.perf_counter(), 0
    with Progress("precompile", total=len(todo)) as bar:
        for job, _, error in precompile.compile_jobs(todo, args.processes):
            bar.update(job.kind)
            bar.advance()
            if error is not None:
                failed += 1
                bar.echo(f"failed: {job.kind} {job.config}: {error}")
    print(f"{len(todo) - failed}/{len(todo)} kernels built in {time.perf_counter() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
