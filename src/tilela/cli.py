"""Command line: ``tilela demo`` (the main job) and ``tilela bench`` (the benchmark harness)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tilela", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="GDN forward on a prefill-like input, checked against the float64 reference and timed")
    sub.add_parser("bench", help="benchmark ours against FLA and FlashQLA (needs a Hopper GPU); see `tilela bench --help`",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        if rest:
            parser.error(f"demo takes no arguments, got {rest}")
        from . import demo

        result = demo.main()
        return 0 if result["rel_err_o"] < 1e-2 and result["rel_err_state"] < 1e-2 else 1
    from . import bench

    return bench.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
