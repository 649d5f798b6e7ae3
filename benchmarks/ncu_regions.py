"""Where a kernel's warps spend their time, from Nsight Compute's source page (benchmarks/ncu_profile.sh's
ncu-<kernel>-source.csv, SASS): the warp-stall samples and executed instructions by opcode, by stall reason, and
by region, a region being the instructions up to and including a CTA barrier (BAR), an mbarrier wait or an EXIT,
so that each stage of a kernel separated by barriers is one line.

    python benchmarks/ncu_regions.py ncu-kkt_solve-source.csv [--min-share 0.01] [--opcodes 18]

Each region line: its first and last SASS index, its share of the samples and of the executed warp instructions,
its most executed opcodes (thousands of warp instructions), its top stall reasons (share of its samples) and the
instruction that closes it.
"""

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers ("@!P1 LDS.128 R4, [R1]" -> "LDS")."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else ""


def closes_region(source: str) -> bool:
    op = opcode(source)
    return op in ("BAR", "EXIT") or (op == "SYNCS" and "TRYWAIT" in source)


def read(path: str) -> tuple[list[str], list[list[str]]]:
    """The source page's header and instruction rows (the file starts with a kernel-name line)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, row in enumerate(rows) if SAMPLES in row)
    return rows[start], [row for row in rows[start + 1:] if len(row) == len(rows[start])]


def analyse(header: list[str], rows: list[list[str]]) -> dict:
    col = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = [number(r[col[SAMPLES]]) for r in rows]
    executed = [number(r[col[EXECUTED]]) for r in rows]
    out = {"samples": sum(samples), "executed": sum(executed), "opcodes": collections.Counter(),
           "opcodes_executed": collections.Counter(), "stalls": collections.Counter(), "regions": []}
    region = None
    for k, row in enumerate(rows):
        if region is None:
            region = {"first": k, "samples": 0.0, "executed": 0.0, "opcodes": collections.Counter(),
                      "stalls": collections.Counter()}
        op = opcode(row[col["Source"]])
        out["opcodes"][op] += samples[k]
        out["opcodes_executed"][op] += executed[k]
        region["samples"] += samples[k]
        region["executed"] += executed[k]
        region["opcodes"][op] += executed[k]
        for s in stalls:
            out["stalls"][s[len("stall_"):]] += number(row[col[s]])
            region["stalls"][s[len("stall_"):]] += number(row[col[s]])
        if closes_region(row[col["Source"]]):
            region.update(last=k, closing=row[col["Source"]].strip())
            out["regions"].append(region)
            region = None
    if region is not None:
        region.update(last=len(rows) - 1, closing="")
        out["regions"].append(region)
    return out


def report(result: dict, min_share: float, opcodes: int) -> str:
    total, executed = max(result["samples"], 1.0), max(result["executed"], 1.0)
    lines = [f"samples {result['samples']:.0f}, warp instructions executed {result['executed']:.0f}",
             "by opcode (share of samples, of executed):"]
    for op, value in result["opcodes"].most_common(opcodes):
        lines.append(f"  {op:10s} {100 * value / total:5.1f}% {100 * result['opcodes_executed'][op] / executed:5.1f}%")
    lines.append("stalls: " + ", ".join(f"{s} {100 * v / total:.1f}%" for s, v in result["stalls"].most_common(9)))
    lines.append("regions (SASS indices, share of samples, of executed | top opcodes executed | top stalls | closed by):")
    for g in result["regions"]:
        if g["samples"] / total < min_share:
            continue
        tops = ", ".join(f"{op}:{int(v) // 1000}k" for op, v in g["opcodes"].most_common(6))
        stalls = ", ".join(f"{s} {100 * v / max(g['samples'], 1.0):.0f}%" for s, v in g["stalls"].most_common(3))
        lines.append(f"  {g['first']:5d}..{g['last']:5d} {100 * g['samples'] / total:5.1f}% "
                     f"{100 * g['executed'] / executed:5.1f}% | {tops} | {stalls} | {g['closing'][:40]}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu's source page as CSV (benchmarks/ncu_profile.sh)")
    parser.add_argument("--min-share", type=float, default=0.01, help="regions below this share of samples are left out")
    parser.add_argument("--opcodes", type=int, default=18)
    args = parser.parse_args(argv)
    print(report(analyse(*read(args.csv)), args.min_share, args.opcodes))


if __name__ == "__main__":
    main(sys.argv[1:])
