"""Every ladder level's state/output kernel (chunk_fwd: gate x update rule, GDN included), the warp-specialised
pass (chunk_fwd_ws: no gate, a scalar one, or the per-channel factors of gla and KDA; DV blocks K / 2 and K, K / 4
and K / 8 for a few, and the state-only
transition pass of the sequence split) and the level-1 sequence-in-grid kernel lower and nvcc-compile for sm_90a (no
GPU needed), with the tile configuration the launchers use, in bf16 and fp16, K = V in {64, 128} (GDN also 256).
The varlen / initial-state / final-state switches rotate over the cases.  Configurations are compiled once, in
parallel over the machine's cores; a register spill fails the compile."""

import os
import re
import shutil
from concurrent.futures import ProcessPoolExecutor

import pytest

tilelang = pytest.importorskip("tilelang")

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found"),
]

SMEM_LIMIT = 227 * 1024  # opt-in dynamic shared memory per CTA on sm_90
FLAGS = [(True, True, True), (False, False, True), (True, False, False), (False, True, False)]

# (kind, gate, delta, K, dtype, beta dtype, (is_varlen, use_initial_state, store_final_state))
LEVELS = [
    ("chunk_fwd", "none", False),  # 1 linear_attn
    ("chunk_fwd", "scalar", False),  # 2 simple_gla
    ("chunk_fwd", "channel", False),  # 3 gla
    ("chunk_fwd", "none", True),  # 4 delta_rule
    ("chunk_fwd", "scalar", True),  # GDN
    ("seq_in_grid", "none", False),  # 1 linear_attn, sequence in the grid
    ("ws_half", "none", False),  # warp-specialised levels 1, 2, 4 and GDN, DV blocks of V / 2 and V
    ("ws_full", "none", False),
    ("ws_half", "scalar", False),
    ("ws_full", "scalar", False),
    ("ws_half", "none", True),
    ("ws_full", "none", True),
    ("ws_half", "scalar", True),
    ("ws_full", "scalar", True),
]
CASES = [
    (kind, gate, delta, K, dtype, "float32" if delta else None, FLAGS[(n + 2 * m) % len(FLAGS)])
    for n, (kind, gate, delta) in enumerate(LEVELS)
    for m, (K, dtype) in enumerate([(64, "bfloat16"), (128, "bfloat16"), (64, "float16"), (128, "float16")])
] + [
    ("ws_full", "scalar", True, 128, "float16", "float16", FLAGS[0]),
    ("ws_quarter", "scalar", True, 128, "bfloat16", "float32", FLAGS[0]),  # GDN, DV blocks of K / 4 and K / 8
    ("ws_eighth", "scalar", True, 128, "bfloat16", "float32", FLAGS[1]),
    ("ws_eighth", "none", True, 128, "bfloat16", "float32", FLAGS[2]),  # delta_rule's default up to one wave
    ("ws_eighth", "none", True, 128, "float16", "float32", FLAGS[3]),
    ("ws_quarter", "none", False, 64, "float16", None, FLAGS[2]),  # 16 columns: linear attention at K = 64
    # gla: the per-channel gate's factors in the q, k and P slots, every DV block the default picks
    ("ws_full", "channel", False, 128, "bfloat16", None, FLAGS[0]),
    ("ws_half", "channel", False, 128, "float16", None, FLAGS[1]),
    ("ws_quarter", "channel", False, 128, "bfloat16", None, FLAGS[2]),
    ("ws_full", "channel", False, 64, "float16", None, FLAGS[3]),
    ("ws_half", "channel", False, 64, "bfloat16", None, FLAGS[0]),
    ("ws_quarter", "channel", False, 64, "float16", None, FLAGS[1]),
    # KDA: the factors in the q and k slots, Kg and P in their own, Ab = A diag(beta) in A's; DV blocks below K
    ("ws_half", "channel", True, 128, "bfloat16", "float32", FLAGS[0]),
    ("ws_quarter", "channel", True, 128, "float16", "float32", FLAGS[1]),
    ("ws_half", "channel", True, 64, "float16", "float32", FLAGS[2]),
    # the sequence split's transitions, state alone: value [V | 0] (V = 2K) from [0 | I] with the delta rule, V
    # from a zero state without (no initial state read)
    ("ws_split_full", "scalar", True, 128, "bfloat16", "float32", (True, False, True)),
    ("ws_split_half", "none", True, 64, "float16", "float32", (True, False, True)),
    ("ws_split_full", "scalar", False, 128, "float16", None, (True, False, True)),
    ("ws_split_half", "none", False, 128, "bfloat16", None, (True, False, True)),
    ("ws_split_quarter", "scalar", False, 128, "bfloat16", None, (True, False, True)),
    ("ws_split_half", "channel", True, 128, "bfloat16", "float32", (True, False, True)),  # KDA's, DV blocks below K
    ("ws_split_quarter", "channel", True, 64, "float16", "float32", (True, False, True)),
    # GDN's split under the warm-up table: the transitions where it leaves them, the outputs from the warm-up start
    ("ws_warmsplit_full", "scalar", True, 128, "bfloat16", "float32", (True, False, True)),
    ("ws_warmsplit_half", "scalar", True, 64, "float16", "float16", (True, False, True)),
    ("ws_warm_quarter", "scalar", True, 128, "bfloat16", "float32", FLAGS[0]),
    ("ws_warm_full", "scalar", True, 64, "float16", "float32", (True, True, False)),
    ("ws_warm_full", "scalar", True, 128, "bfloat16", "float32", (True, False, True)),  # GDN's, transposed chains
    ("ws_warm_half", "scalar", True, 128, "bfloat16", "float32", (True, False, True)),
    # GDN's pass with the output folded into its two chain groups (make_plan's fold)
    ("ws_fold_full", "scalar", True, 128, "bfloat16", "float32", FLAGS[0]),
    ("ws_fold_full", "scalar", True, 128, "float16", "float16", FLAGS[1]),
    ("ws_fold_full", "scalar", True, 128, "bfloat16", "float32", FLAGS[3]),
    ("ws_fold_full", "scalar", True, 128, "bfloat16", "bfloat16", FLAGS[2]),
    ("chunk_fwd", "scalar", True, 128, "float16", "float16", FLAGS[0]),  # GDN with a half-precision beta
    ("chunk_fwd", "scalar", True, 256, "bfloat16", "float32", FLAGS[0]),
    ("chunk_fwd", "scalar", True, 256, "float16", "float32", FLAGS[1]),
    ("chunk_fwd", "channel", True, 128, "bfloat16", "float32", FLAGS[0]),  # KDA
    ("chunk_fwd", "channel", True, 64, "float16", "float32", FLAGS[3]),
    ("chunk_fwd", "channel", True, 128, "float16", "float32", FLAGS[1]),
    ("chunk_fwd16", "channel", True, 128, "bfloat16", "float32", FLAGS[0]),  # KDA's short-chunk path
    ("chunk_fwd16", "channel", True, 64, "float16", "float32", FLAGS[2]),
]


DV_FRACTION = {"full": 1, "half": 2, "quarter": 4, "eighth": 8}  # K / DV block of the ws kinds
# ptxas fails the compile on a register spill (the warp-specialised pass's setmaxnreg budgets leave little slack)
NO_SPILLS = ["--ptxas-options=--warn-on-spills,--warning-as-error"]


def _lower(case):
    """(CUDA source, dynamic shared memory bytes) of one configuration; nvcc compiles it (an error raises)."""
    from tilelang import tvm

    from tilela.experiments.linear_attn_seq_in_grid import linear_attn_seq_in_grid_kernel
    from tilela.kernels.hopper.chunk_fwd import chunk_fwd_kernel
    from tilela.kernels.hopper.chunk_fwd_ws import chunk_fwd_ws_kernel
    from tilela.kernels.hopper.common import pass_configs
    from tilela.kernels.hopper.launch import GUARDED
    from tilela.kernels.hopper.plan import loop_tiles

    kind, gate, delta, K, dtype, beta_dtype, flags = case
    H, HV = 2, 4
    if kind.startswith("chunk_fwd"):
        builder = chunk_fwd_kernel
        func = builder(K, K, K**-0.5, gate, delta, dtype, beta_dtype or "float32", *flags,
                       *loop_tiles(K, gate, delta, dtype, 16 if kind == "chunk_fwd16" else 64))
    elif kind.startswith("ws"):
        builder = chunk_fwd_ws_kernel
        split = kind.startswith(("ws_split", "ws_warmsplit"))
        V = 2 * K if split and delta else K  # the transitions' [V | 0] value with the delta rule
        func = builder(K, V, K**-0.5, gate, delta, dtype, beta_dtype or "float32", *flags,
                       K // DV_FRACTION[kind.rsplit("_", 1)[1]], not split, kind.startswith("ws_warm"),
                       kind.startswith("ws_fold"))
    else:
        builder = linear_attn_seq_in_grid_kernel
        func = builder(H, HV, K, K, K**-0.5, dtype, *flags)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    config = dict(pass_configs(True, builder in GUARDED), **{"tl.device_compile_flags": NO_SPILLS})
    with tvm.transform.PassContext(config=config), target:
        artifact = tilelang.lower(func, target=target, enable_device_compile=True)
    (device_func,) = artifact.device_mod.functions.values()
    return artifact.kernel_source, int(device_func.attrs["dyn_shared_memory_buf"])


@pytest.fixture(scope="module")
def compiled():
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(CASES, pool.map(_lower, CASES)))


def _case_id(case):
    kind, gate, delta, K, dtype, beta_dtype, flags = case
    rule = "delta" if delta else "plain"
    switches = "-".join(name for name, on in zip(("varlen", "h0", "ht"), flags) if on) or "dense"
    return f"{kind}-{gate}-{rule}-K{K}-{dtype}-{beta_dtype or 'nobeta'}-{switches}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_compiles_for_sm90a(compiled, case):
    source, smem = compiled[case]
    # the input-dtype GEMMs on Hopper's warpgroup tensor-core instructions; chunk 16's two warps on mma.sync
    assert ("mma_sync" if case[0] == "chunk_fwd16" else "wgmma") in source
    assert smem <= SMEM_LIMIT, f"{smem} bytes of shared memory"
    kind, gate, delta, K, *_ = case
    # the transposed chain groups (chunk_fwd_ws.WsConfig.transposed): each product's left operand from registers
    transposed = kind in ("ws_full", "ws_half", "ws_warm_full", "ws_warm_half", "ws_fold_full") and delta \
        and gate != "channel" and K == 128
    assert ("wgmma_rs" in source) == transposed
    if kind.startswith("ws"):  # launch.GUARDED: no per-access bounds tests (e.g. of the batch index against B)
        assert not re.search(r"\(bb(_\d+)? < B\)", source)
        # the delta rule's output group stores whole chunks of O by TMA at DV blocks 64 and 128 (WsConfig.tma_output)
        block_DV = K // DV_FRACTION[kind.rsplit("_", 1)[1]]
        outputs = not kind.startswith(("ws_split", "ws_warmsplit"))
        # the warm-up's transitions form the table's rows: the segment's sequence counted, an unbounded segment found
        assert ("__syncthreads_count(" in source and "__syncthreads_or(" in source) == kind.startswith("ws_warmsplit")
        assert ("tl::tma_store(o_desc" in source) == (delta and gate != "channel" and outputs and block_DV in (64, 128))
        # folded: the chain groups wait for the scores group's P ("scored"); no S_s or Vnew_s hand-over
        assert ("scored[" in source) == kind.startswith("ws_fold")
        assert ("S_ready[" in source) != (kind.startswith("ws_fold") or not delta and not outputs)
