"""Shared-memory wavefronts of a kernel's generated CUDA, counted per access statement without a device.

    python benchmarks/smem_banks.py kkt "(64, 'blocked', 'bfloat16', 'scalar', 2, ('float32', 'log'), True)"
    python benchmarks/smem_banks.py --source kernel.cu [--threads 128]

Compiles one configuration for sm_90a as the launchers do (kernels.hopper.launch.jit_kernel; kind kkt or gla, and
its builder's static arguments as tilela.kernels.hopper lists them), or reads a saved source, and for every shared-
memory access in it (scalar and vector loads and stores through a dynamic-shared buffer, ldmatrix) evaluates each
lane's byte address over every warp that runs it (a branch on the thread index runs its own) and every value of the
enclosing loops with constant bounds. A warp's request splits into phases by its width (32 lanes of up to 4 bytes,
16 of 8, 8 of 16; ldmatrix four phases of 8 row addresses), and a phase takes as many wavefronts as the most
distinct 4-byte words any one of the 32 banks holds; ideal is its distinct words over 32, rounded up (ncu's "L1
Wavefronts Shared" and "... Ideal"). Assumed: every lane active (predicates are not evaluated), variables other than
the thread index and constant-bound loop counters 0 (uniform over the warp; offsets they add are taken as multiples
of 128 bytes), loops with other bounds run once, and each access as the source writes it (ptxas may merge
neighbouring scalar loads into one vector load, as it does with level 0's row reads in kkt_solve, which ncu then
counts as that). TMA and wgmma operand traffic is not counted.
"""

import argparse
import itertools
import math
import re
import sys

SIZES = {"float": 4, "int": 4, "half_t": 2, "bfloat16_t": 2, "uint1": 4, "uint2": 8, "uint4": 16, "float2": 8,
         "float4": 16, "half2": 4, "int2": 8, "int4": 16, "signed char": 1, "char": 1, "uchar": 1}
BANKS = 32
BASE = re.compile(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);")
LOOP = re.compile(r"for \(int (\w+) = (-?\d+); \1 < (\S+?); \+\+\1\)")
VECTOR = re.compile(r"\*\((\w+)\*\)\(\(\((\w+)\*\)(\w+)\) \+ ")
SCALAR = re.compile(r"\(\((\w+)\*\)(\w+)\)\[")
LDMATRIX = re.compile(r"tl::ptx_ldmatrix_x(\d)(_trans)?\(\(&\(\(\((\w+)\*\)(\w+)\)\[")
THREAD_RANGE = re.compile(r"^\s*(\} else )?if \(\(\(int\)threadIdx\.x\) < (\d+)\) \{")
ELSE = re.compile(r"^\s*\} else ")


def closing(text: str, start: int, opening: str = "(", close: str = ")") -> int:
    """Index of the bracket closing the one opened just before text[start]."""
    depth = 1
    for i in range(start, len(text)):
        depth += (text[i] == opening) - (text[i] == close)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced {opening!r} from column {start}: {text[start:start + 80]!r}")


def python_expr(expr: str) -> str:
    """A C index expression over int as a Python one (non-negative operands: / and % agree)."""
    expr = expr.replace("((int)threadIdx.x)", "tx").replace("(int)threadIdx.x", "tx")
    expr = re.sub(r"blockIdx\.([xyz])", r"block_\1", expr).replace("(int)", "")
    return re.sub(r"(?<![/])/(?![/])", "//", expr)


def accesses(line: str, buffers: dict):
    """(kind, buffer, element bytes, access bytes, lanes a phase, expression) of each shared access on a line."""
    found = []
    for m in LDMATRIX.finditer(line):
        end = closing(line, m.end(), "[", "]")
        if m.group(4) in buffers:
            found.append(("ldmatrix" + (".trans" if m.group(2) else ""), m.group(4), SIZES[m.group(3)], 16, 8,
                          line[m.end():end]))
    taken = [(m.start(), closing(line, m.end(), "[", "]")) for m in LDMATRIX.finditer(line)]
    for m in VECTOR.finditer(line):
        end = closing(line, m.end())
        if m.group(3) not in buffers or m.group(1) not in SIZES:
            continue
        taken.append((m.start(), end))
        store = re.match(r"\) = ", line[end:]) is not None
        width = SIZES[m.group(1)]
        found.append(("st" if store else "ld", m.group(3), SIZES[m.group(2)], width, BANKS * 4 // max(width, 4),
                      line[m.end():end]))
    for m in SCALAR.finditer(line):
        if m.group(2) not in buffers or any(a <= m.start() < b for a, b in taken):
            continue
        end = closing(line, m.end(), "[", "]")
        store = re.match(r"\] = ", line[end:]) is not None
        width = SIZES[m.group(1)]
        found.append(("st" if store else "ld", m.group(2), width, width, BANKS, line[m.end():end]))
    return found


def phase_wavefronts(addresses: list, width: int) -> tuple:
    """(wavefronts, ideal) of one phase's byte addresses, each access `width` bytes."""
    words = {(a + o) // 4 for a in addresses for o in range(0, max(width, 4), 4)}
    per_bank = {}
    for w in words:
        per_bank.setdefault(w % BANKS, set()).add(w)
    return max(len(v) for v in per_bank.values()), math.ceil(len(words) / BANKS)


def count(source: str, threads: int):
    """One row a shared access: (line, kind, buffer, bytes, executions a thread, wavefronts and ideal a warp
    instruction (means), unknown names, warps that run it), in source order. A branch on the thread index
    (`if (((int)threadIdx.x) < N)` and its `else`) runs only its own warps (a warp with any thread in range)."""
    buffers = {name: int(offset) for name, offset in BASE.findall(source)}
    every = frozenset(range(threads // 32))
    # each open brace's (loop counter, its values, the warps that run its body); a thread-range if's (outer, own)
    rows, scopes, pending, branch, pending_warps = [], [], None, {}, None
    for number, line in enumerate(source.splitlines(), 1):
        loop = LOOP.search(line)
        if loop:
            bound = loop.group(3)
            pending = (loop.group(1), range(int(loop.group(2)), int(bound))) if bound.isdigit() else \
                (loop.group(1), None)
        depth = len(scopes) - (1 if line.lstrip().startswith("}") else 0)
        outer = scopes[depth - 1][2] if depth > 0 else every
        ranged, other = THREAD_RANGE.search(line), ELSE.search(line)
        if other and depth in branch:  # `} else {` / `} else if (...)`: the warps the if at this depth left
            outer = branch[depth][0] - branch[depth][1]
        if ranged:
            own = frozenset(w for w in outer if 32 * w < int(ranged.group(2)))
            branch[depth], pending_warps = (outer, own), own
        elif other and depth in branch:
            pending_warps = outer
        elif "if (" in line:  # another condition at this depth: a later else is its own
            branch.pop(depth, None)
        active = scopes[-1][2] if scopes else every
        for kind, buf, elem, width, lanes, expr in accesses(line, buffers):
            known = {name: values for name, values, _ in scopes if values is not None}
            code = python_expr(expr)
            names = set(re.findall(r"[A-Za-z_]\w*", code)) - {"tx"}
            unknown = sorted(names - set(known))
            combos = list(itertools.product(*(known[n] for n in sorted(names & set(known)))))
            step = max(1, len(combos) // 64)
            total = ideal = samples = 0
            for combo in combos[::step]:
                env = dict(zip(sorted(names & set(known)), combo), **dict.fromkeys(unknown, 0))
                for warp in sorted(active):
                    byte = [buffers[buf] + eval(code, {}, dict(env, tx=32 * warp + lane)) * elem  # noqa: S307
                            for lane in range(32)]
                    for p in range(0, 32, lanes):
                        w, i = phase_wavefronts(byte[p:p + lanes], width)
                        total, ideal = total + w, ideal + i
                    samples += 1
            runs = math.prod(len(known[n]) for n in known)
            rows.append((number, kind, buf, width, runs, total / max(samples, 1), ideal / max(samples, 1), unknown,
                         len(active)))
        opened, shut = line.count("{"), line.count("}")
        leading = shut if line.lstrip().startswith("}") else 0  # "} else {": the closing brace comes first
        del scopes[len(scopes) - min(leading, len(scopes)):]
        inner = scopes[-1][2] if scopes else every
        if opened and (pending is not None or pending_warps is not None):
            scopes.append((*(pending or ("", None)), inner if pending_warps is None else pending_warps))
            opened -= 1
            pending = pending_warps = None
        scopes.extend([("", None, scopes[-1][2] if scopes else every)] * opened)
        del scopes[len(scopes) - min(shut - leading, len(scopes)):]
    return rows


def lowered(kind: str, static: tuple) -> str:
    """The generated CUDA of one configuration, as the launchers compile it (TileLang's disk cache reused)."""
    from tilela.kernels.hopper import launch

    builder = {"kkt": launch.kkt_solve_kernel, "gla": launch.gla_factors_kernel}[kind]
    return launch.jit_kernel(builder, *static).get_kernel_source()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", nargs="?", choices=("kkt", "gla"))
    parser.add_argument("static", nargs="?", help="the builder's static arguments as a Python tuple")
    parser.add_argument("--source", help="a saved kernel source instead of lowering one")
    parser.add_argument("--threads", type=int, help="threads a CTA (default: the source's __launch_bounds__)")
    args = parser.parse_args(argv)
    if args.source:
        source = open(args.source).read()
    elif args.kind and args.static:
        import ast

        source = lowered(args.kind, ast.literal_eval(args.static))
    else:
        parser.error("give a kind and its static arguments, or --source")
    bounds = re.search(r"__launch_bounds__\((\d+)", source)
    threads = args.threads or (int(bounds.group(1)) if bounds else 128)
    rows = count(source, threads)
    print("| line | access | buffer | bytes | runs | warps | wavefronts a warp | ideal | excess a CTA pass | unknown "
          "(0) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    excess = wavefronts = 0
    for number, kind, buf, width, runs, w, i, unknown, warps in rows:
        excess += (w - i) * runs * warps
        wavefronts += w * runs * warps
        print(f"| {number} | {kind} | {buf} | {width} | {runs} | {warps} | {w:.2f} | {i:.2f} | "
              f"{(w - i) * runs * warps:.0f} | {' '.join(unknown)} |")
    print(f"\n{len(rows)} accesses; a pass of every statement once (loops with constant bounds unrolled, others once): "
          f"{wavefronts:.0f} wavefronts, {excess:.0f} over ideal ({excess / max(wavefronts, 1):.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
