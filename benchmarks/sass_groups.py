"""What each warp group of a warp-specialised kernel executes, read from its SASS without a GPU: the listing is split
where a group sets its registers (USETMAXREG), so each section is one group's code (the prologue before the first,
shared by all), and each section's loop bodies (a backward branch's target up to the branch) are counted by opcode.

    python benchmarks/sass_groups.py k.sass [--opcodes 12]
    python benchmarks/sass_groups.py --pass OUT_DIR        lower and compile the folded GDN pass (K = V = 128, bf16,
                                                           fp32 beta, varlen with final states) and read its SASS

The listing is `cuobjdump -sass` output (cuobjdump comes with the CUDA toolkit, or from PyPI's nvidia-cuda-cuobjdump;
CUOBJDUMP names it). --pass writes OUT_DIR/k.cu, the cubin and OUT_DIR/k.sass. Each section line: its registers
after setmaxnreg, its instruction count, then per loop the instruction count and the opcodes that decide a
group's latency (tensor-core products and their waits, shared loads and stores, exponentials, barriers, fences,
local-memory spills) and its most frequent opcodes. Counts are static: a loop runs once per chunk, and predicated
instructions count as issued.
"""

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_regions import opcode  # noqa: E402  (the script beside this one)

KEY_OPCODES = ("HGMMA", "WARPGROUP", "LDS", "STS", "MUFU", "BAR", "MEMBAR", "SYNCS", "LDL", "STL")
MIN_LOOP = 16
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def instructions(text: str) -> list[tuple[int, str]]:
    """(address, instruction) for each SASS instruction of a listing (the encoding lines left out)."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(LINE.search, text.splitlines()) if m]


def sections(code: list[tuple[int, str]]) -> list[dict]:
    """The listing up to its last EXIT (after it: the out-of-line retries of mbarrier waits) split before each
    USETMAXREG: the prologue (registers None), then one section per group."""
    last_exit = max((k for k, (_, source) in enumerate(code) if opcode(source) == "EXIT"), default=len(code) - 1)
    out = [{"registers": None, "code": []}]
    for address, source in code[: last_exit + 1]:
        if opcode(source) == "USETMAXREG":
            registers = re.search(r"0x([0-9a-f]+)\s*$", source)
            out.append({"registers": int(registers.group(1), 16) if registers else None, "code": []})
        out[-1]["code"].append((address, source))
    return out


def loops(code: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """The outermost loop bodies of a section of at least MIN_LOOP instructions (not a spin wait): from a backward
    branch's target within the section to the branch."""
    first = code[0][0] if code else 0
    spans = []
    for address, source in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", source)
        if opcode(source) == "BRA" and target and first <= int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            spans = [s for s in spans if not start <= s[0]] + [(start, address)]
    bodies = [[(a, s) for a, s in code if lo <= a <= hi] for lo, hi in spans]
    return [body for body in bodies if len(body) >= MIN_LOOP]


def counts(code: list[tuple[int, str]]) -> collections.Counter:
    return collections.Counter(opcode(source) for _, source in code)


def report(text: str, opcodes: int = 12) -> str:
    lines = []
    for n, section in enumerate(sections(instructions(text))):
        name = "prologue" if section["registers"] is None else f"group {n} ({section['registers']} registers)"
        lines.append(f"{name}: {len(section['code'])} instructions")
        for body in loops(section["code"]):
            c = counts(body)
            key = " ".join(f"{op} {c[op]}" for op in KEY_OPCODES if c[op])
            top = " ".join(f"{op} {k}" for op, k in c.most_common(opcodes))
            lines.append(f"  loop {body[0][0]:#x}-{body[-1][0]:#x}: {len(body)} instructions; {key}")
            lines.append(f"    most: {top}")
    return "\n".join(lines)


def cuobjdump() -> str:
    """CUOBJDUMP, else cuobjdump on PATH, else the nvidia-cuda-cuobjdump wheel's."""
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia  # the wheel's namespace package
    except ImportError:
        nvidia = None
    for root in [] if nvidia is None else nvidia.__path__:
        for found in glob.glob(os.path.join(root, "*", "bin", "cuobjdump")):
            return found
    raise FileNotFoundError("cuobjdump: set CUOBJDUMP, put it on PATH or pip install nvidia-cuda-cuobjdump")


def build_pass(out_dir: str) -> str:
    """Lower and compile the folded GDN pass for sm_90a into out_dir; its SASS listing."""
    import tilelang
    from tilelang import tvm

    from tilela.kernels.hopper.chunk_fwd_ws import chunk_fwd_ws_kernel
    from tilela.kernels.hopper.common import pass_configs

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    K = 128
    kernel = chunk_fwd_ws_kernel(K, K, K ** -0.5, "scalar", True, "bfloat16", "float32", is_varlen=True,
                                 store_final_state=True, block_DV=K, folded=True)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    config = dict(pass_configs(True, True), **{"cuda.kernels_output_dir": out_dir})
    with tvm.transform.PassContext(config=config), target:
        artifact = tilelang.lower(kernel, target=target, enable_device_compile=True)
    with open(os.path.join(out_dir, "k.cu"), "w") as f:
        f.write(artifact.kernel_source)
    cubin = max(glob.glob(os.path.join(out_dir, "*.cubin")), key=os.path.getmtime)
    text = subprocess.run([cuobjdump(), "-sass", cubin], check=True, capture_output=True, text=True).stdout
    with open(os.path.join(out_dir, "k.sass"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("listing", nargs="?", help="a cuobjdump -sass listing")
    source.add_argument("--pass", dest="pass_dir", help="lower the folded GDN pass into this folder and read it")
    parser.add_argument("--opcodes", type=int, default=12, help="most frequent opcodes shown per loop")
    args = parser.parse_args(argv)
    if args.pass_dir:
        text = build_pass(args.pass_dir)
    else:
        with open(args.listing) as f:
            text = f.read()
    print(report(text, args.opcodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
