"""Reliability on the H200: bitwise-identical reruns of every attention op on our kernels (dense, varlen and the
sequence split), a GDN call past 2^31 elements per tensor checked at the end of its last sequences, and a NaN at a
sequence start that stays in its sequence although the kernels' tiles of the sequences before it load its row."""

import pytest
import torch
import torch.nn.functional as F

import tilela
from tilela import reference
from tilela.bench import rel_l2
from tilela.check import ATTENTION_OPS
from tilela.kernels.hopper import multiprocessors, plan

pytestmark = pytest.mark.gpu

LAYOUTS = {"dense": None, "varlen": (1, 150, 77, 64, 130), "split": (30000, 1, 190)}


def inputs(lengths, B, H, HV, K, gate, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    x = dict(q=F.normalize(randn(B, T, H, K), dim=-1).bfloat16(), k=F.normalize(randn(B, T, H, K), dim=-1).bfloat16(),
             v=randn(B, T, HV, K).bfloat16(), initial_state=randn(B * len(lengths), HV, K, K) * 0.1)
    if gate != "none":
        x["g"] = F.logsigmoid(randn(B, T, HV, *((K,) if gate == "channel" else ())) + 2).clamp_min(-5)
    x["beta"] = randn(B, T, HV).sigmoid()
    return x


def call(op, x, lengths, **kw):
    gate, uses_beta = ATTENTION_OPS[op]
    args = [x["q"], x["k"], x["v"]] + ([x["g"]] if gate != "none" else []) + ([x["beta"]] if uses_beta else [])
    if len(lengths) > 1:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        kw.update(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    extra = {"chunk_linear_attn": {"normalize": False}, "chunk_kda": {"safe_gate": True}}.get(op, {})
    return getattr(tilela, op)(*args, initial_state=x["initial_state"], output_final_state=True, **extra, **kw)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", list(ATTENTION_OPS))
def test_reruns_are_bitwise_identical(op, layout):
    gate, delta = ATTENTION_OPS[op]
    lengths = LAYOUTS[layout] or (300,)
    B = 2 if layout == "dense" else 1
    if layout == "split":
        if not plan.splits(gate, delta):
            pytest.skip(f"{op} takes no sequence split")
        assert plan.auto_split(lengths, 4, multiprocessors(torch.device("cuda")), 128, gate, delta)
    x = inputs(lengths, B, 4, 4, 128, gate, seed=3)
    first = call(op, x, lengths)
    second = call(op, {n: t.clone() for n, t in x.items()}, lengths)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_gdn_past_int32_elements_against_fla_and_float64():
    """1.1M tokens at h16/32 (v and o hold 4.6e9 elements, q and k 2.3e9): the last 700-token sequence against
    the float64 reference and FLA, the end of the long sequence before it against FLA (FLA_FLASH_QLA=0)."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    lengths = (1_100_000 - 700, 700)
    H, HV, K = 16, 32, 128
    x = inputs(lengths, 1, H, HV, K, "scalar", seed=5)
    x["g"] = F.logsigmoid(x["g"] + 1)
    assert x["v"].numel() > 2**31 and x["q"].numel() > 2**31
    o, S = call("chunk_gated_delta_rule", x, lengths)
    tail = slice(lengths[0], None)
    ref_o, ref_S = reference.chunked(*(x[n][:, tail].cpu() for n in ("q", "k", "v", "g", "beta")),
                                     initial_state=x["initial_state"][1:].cpu())
    assert rel_l2(o[:, tail], ref_o) < 1e-2 and rel_l2(S[1:], ref_S) < 1e-2
    end = slice(lengths[0] - 4096, lengths[0])
    o_end = o[:, end].clone()
    del o
    torch.cuda.empty_cache()
    # FLA's call holds its chunk states (NT * HV * K * V in bf16) and four tensors of v's size (w, u, v_new, o)
    need = 2 * (lengths[0] // 64 + 2) * HV * K * K + 4 * x["v"].numel() * 2
    free = torch.cuda.mem_get_info()[0]
    if free < need:  # other processes on the device (parallel test workers)
        pytest.skip(f"FLA's comparison needs {need / 2**30:.1f} GiB free on the device, {free / 2**30:.1f} GiB free")
    cu = torch.tensor([0, lengths[0], sum(lengths)], device="cuda")  # tilela.bench set FLA_FLASH_QLA=0 on import
    fla_o, fla_S = fla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                              initial_state=x["initial_state"], output_final_state=True,
                                              cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    assert rel_l2(o_end, fla_o[:, end]) < 1e-2 and rel_l2(S, fla_S) < 1e-2
    assert rel_l2(fla_o[:, tail], ref_o) < 1e-2


TAIL_LENGTHS = (70, 40, 130, 1, 100)  # sequence 2 starts at token 110, inside the last 64-row tiles of 0 and 1
POISON = [(op, K, name) for op, (gate, delta) in ATTENTION_OPS.items() for K in (128, 256)
          if plan.covers("bfloat16", K, K, gate, delta)
          for name in ("q", "k", "v") + ("g",) * (gate != "none") + ("beta",) * delta]


@pytest.mark.parametrize("op,K,name", POISON, ids=[f"{o}-K{K}-{n}" for o, K, n in POISON])
def test_non_finite_at_a_sequence_start_stays_in_its_sequence(op, K, name):
    """NaN at token 113 (sequence 2) sits in the 64-row tiles the kernels load for the last chunks of sequences 0
    and 1 (K = 128: the warp-specialised pass, K = 256: the loop pass): every output and final state outside
    sequence 2 equals the clean run's bit for bit."""
    gate, _ = ATTENTION_OPS[op]
    x = inputs(TAIL_LENGTHS, 1, 2, 4, K, gate, seed=5)
    o_clean, S_clean = call(op, x, TAIL_LENGTHS)
    x[name][0, 113] = float("nan")
    o, S = call(op, x, TAIL_LENGTHS)
    assert not torch.isfinite(o[0, 113:240]).all()  # it reached its own sequence
    outside = torch.ones(o.shape[1], dtype=torch.bool)
    outside[110:240] = False
    assert torch.equal(o[0, outside], o_clean[0, outside])
    others = [n for n in range(len(TAIL_LENGTHS)) if n != 2]
    assert torch.equal(S[others], S_clean[others])
