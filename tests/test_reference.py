"""The float64 reference stack: layers A/B/C/D/E agree, primitives match explicit formulas, inverses match
torch.linalg.inv, the seed documents' degenerate checks, cost tables and deliberate-bug error levels."""
import math
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F

from tilela.reference import chunk_math
from tilela.reference import (blocked_inverse, chunk_local_cumsum, chunked, flat_block_inverse, inverse_cost,
                              kkt_solve, neumann_inverse_16, recurrent, row_forward_inplace, seq_in_grid,
                              seq_in_loop, seq_split)

F64 = torch.float64
GATES = ["none", "scalar", "channel"]
INVERSE_METHODS = ["row", "blocked", "flat", "neumann"]
INVERSE_FNS = {"row": row_forward_inplace, "blocked": blocked_inverse, "flat": flat_block_inverse,
               "neumann": neumann_inverse_16}


def make_gate(gate, B, T, HV, K, gen):
    """logsigmoid gate; head 0 decays hard (g = -20 per token), head 1 not at all (g = 0)."""
    if gate == "none":
        return None
    g = F.logsigmoid(torch.randn(B, T, HV, *([K] if gate == "channel" else []), generator=gen, dtype=F64))
    g[:, :, 0] = -20.0
    g[:, :, 1] = 0.0
    return g


def make_problem(gate, delta, lengths=None, B=2, T=45, H=2, G=3, K=8, V=12, seed=0):
    """GVA ratio G, K != V, l2-normalised k, beta in (0, 1), random initial state; varlen when lengths given."""
    gen = torch.Generator().manual_seed(seed)
    cu = None
    if lengths is not None:
        B, T = 1, sum(lengths)
        cu = torch.tensor([0, *accumulate(lengths)])
    N, HV = (B if cu is None else len(cu) - 1), H * G
    q = torch.randn(B, T, H, K, generator=gen, dtype=F64)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=F64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=F64) if delta else None
    return dict(q=q, k=k, v=v, g=make_gate(gate, B, T, HV, K, gen), beta=beta,
                initial_state=torch.randn(N, HV, K, V, generator=gen, dtype=F64), cu_seqlens=cu)


LAYERS = {
    "B_chunked": lambda C, **kw: chunked(**kw, chunk_size=C),
    "C_seq_in_grid": lambda C, **kw: seq_in_grid(**kw, chunk_size=C),
    "D_seq_in_loop": lambda C, **kw: seq_in_loop(**kw, chunk_size=C, block_dv=8),
    "E_seq_split_2": lambda C, **kw: seq_split(**kw, chunk_size=C, segment_chunks=2),
    "E_seq_split_1": lambda C, **kw: seq_split(**kw, chunk_size=C, segment_chunks=1),
}


@pytest.mark.parametrize("delta", [False, True], ids=["plain", "delta"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("lengths,C", [(None, 16), ([37, 1, 0, 20, 33], 16), ([150, 1, 0, 64, 70], 64)],
                         ids=["batch-C16", "varlen-C16", "varlen-C64"])
def test_layers_agree_with_recurrence(gate, delta, lengths, C):
    """C = 64 with g = -20 per token drives exp(gc) to underflow: any positive exponent would give inf/NaN."""
    problem = make_problem(gate, delta, lengths)
    o_ref, S_ref = recurrent(**problem)
    assert torch.isfinite(o_ref).all() and torch.isfinite(S_ref).all()
    for name, layer in LAYERS.items():
        o, S = layer(C, **problem)
        assert o.dtype == F64 and S.dtype == F64
        torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12, msg=name)
        torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-12, msg=name)


def test_recurrence_matches_explicit_sum():
    """Layer A against o_i = scale sum_{j<=i} (q_i.k_j) v_j + scale q_i^T S0 (level 1, GVA ratio 3)."""
    p = make_problem("none", False, B=1, T=9)
    o, S = recurrent(**p)
    q, k = (p[name][0].repeat_interleave(3, dim=1) for name in ("q", "k"))  # GVA: value head h reads h // 3
    v, S0 = p["v"][0], p["initial_state"][0]
    scores = torch.einsum("ihd,jhd->hij", q, k).tril()
    expected = (torch.einsum("hij,jhv->ihv", scores, v) + torch.einsum("ihk,hkv->ihv", q, S0)) * 8 ** -0.5
    torch.testing.assert_close(o[0], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(S[0], S0 + torch.einsum("jhk,jhv->hkv", k, v), rtol=0, atol=1e-12)


@pytest.mark.parametrize("gate,delta", [("channel", True), ("scalar", False)])
def test_dv_split_is_dependency_free(gate, delta):
    """Same numbers for every block_dv; only the BLAS kernel choice per GEMM width may move the last ulp."""
    problem = make_problem(gate, delta, [70, 1, 0, 33], K=16, V=128)
    o32, S32 = seq_in_loop(**problem, chunk_size=32, block_dv=32)
    for block_dv in (64, 128):
        o, S = seq_in_loop(**problem, chunk_size=32, block_dv=block_dv)
        torch.testing.assert_close(o, o32, rtol=0, atol=1e-14)
        torch.testing.assert_close(S, S32, rtol=0, atol=1e-14)
    o_ref, S_ref = recurrent(**problem)
    torch.testing.assert_close(o32, o_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("gate", GATES)
def test_gated_factors_give_the_chunk_step(gate):
    """The state-independent factors (Qg, Kd, P) the GLA pre-pass computes: O = scale Qg S0 + P V and
    S_next = exp(gc_last) ⊙ S0 + Kd^T V equal chunk_forward's plain-update step (per key channel, scalar, none)."""
    p = make_problem(gate, False, B=1, T=16, H=2, G=1)
    q, k, v, S0 = p["q"][0].transpose(0, 1), p["k"][0].transpose(0, 1), p["v"][0].transpose(0, 1), \
        p["initial_state"][0]
    g = torch.zeros(1, 16, 2, 1, dtype=F64) if p["g"] is None else p["g"]
    gc = g.reshape(1, 16, 2, -1).cumsum(1)[0].transpose(0, 1)  # [HV, L, 1 or K]
    scale = 8 ** -0.5
    O, S_next = chunk_math.chunk_forward(q, k, v, gc, None, S0, scale)
    Qg, Kd, P = chunk_math.gated_factors(q, k, gc, scale)
    torch.testing.assert_close(scale * Qg @ S0 + P @ v, O, rtol=0, atol=1e-12)
    decay = gc[:, -1, :].exp()[..., None]
    torch.testing.assert_close(decay * S0 + Kd.transpose(-1, -2) @ v, S_next, rtol=0, atol=1e-12)


@pytest.mark.parametrize("gate", GATES)
def test_gated_factors_give_the_delta_rule_step(gate):
    """The warp-specialised pass's per-channel delta rule (KDA) from the factors and Kg = K ⊙ exp(gc):
    Vnew = A diag(beta) (V - Kg S0), O = scale Qg S0 + P Vnew, S_next = exp(gc_last) ⊙ S0 + Kd^T Vnew equal
    chunk_forward's delta-rule step."""
    p = make_problem(gate, True, B=1, T=16, H=2, G=1)
    q, k, v, beta = (p[n][0].transpose(0, 1) for n in ("q", "k", "v", "beta"))
    S0 = p["initial_state"][0]
    g = torch.zeros(1, 16, 2, 1, dtype=F64) if p["g"] is None else p["g"]
    gc = g.reshape(1, 16, 2, -1).cumsum(1)[0].transpose(0, 1)  # [HV, L, 1 or K]
    scale = 8 ** -0.5
    O, S_next = chunk_math.chunk_forward(q, k, v, gc, beta, S0, scale)
    Qg, Kd, P = chunk_math.gated_factors(q, k, gc, scale)
    Kg, A = k * gc.exp(), chunk_math.ut_transform(k, beta, gc)
    Vnew = A @ (beta[..., None] * (v - Kg @ S0))
    torch.testing.assert_close(scale * Qg @ S0 + P @ Vnew, O, rtol=0, atol=1e-12)
    decay = gc[:, -1, :].exp()[..., None]
    torch.testing.assert_close(decay * S0 + Kd.transpose(-1, -2) @ Vnew, S_next, rtol=0, atol=1e-12)


def test_low_precision_inputs_are_upcast():
    p = make_problem("channel", True, B=1, T=20)
    low = {name: (x.to(torch.bfloat16) if name in ("q", "k", "v") else x) for name, x in p.items()}
    o, S = chunked(**low, chunk_size=16)
    o_ref, S_ref = recurrent(**{name: (x.to(torch.bfloat16).to(F64) if name in ("q", "k", "v") else x)
                                for name, x in p.items()})
    assert o.dtype == F64
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)


def _level1_seq_in_loop(q, k, v, C, update_first):
    """Seed 002 §6.4.2 ref_D, level 1; update_first=True is the deliberate bug (inclusive prefix, no right shift)."""
    o = torch.zeros_like(v)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            S = torch.zeros(q.shape[-1], v.shape[-1], dtype=F64)
            for c0 in range(0, q.shape[1], C):
                Q, K, V = q[b, c0:c0 + C, h], k[b, c0:c0 + C, h], v[b, c0:c0 + C, h]
                if update_first:
                    S = S + K.T @ V
                o[b, c0:c0 + C, h] = Q @ S + (Q @ K.T).tril() @ V
                if not update_first:
                    S = S + K.T @ V
    return o


@pytest.mark.parametrize("update_first", [False, True], ids=["right_shift", "bug_update_first"])
def test_right_shift_bug_is_detected(update_first):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 12, 2, 4, generator=gen, dtype=F64) for _ in range(3))
    o_ref, _ = recurrent(q, k, v, scale=1.0)
    o = _level1_seq_in_loop(q, k, v, 4, update_first)
    rel_l2 = ((o - o_ref).norm() / o_ref.norm()).item()
    if update_first:
        assert rel_l2 > 0.3
    else:
        assert rel_l2 < 1e-14


@pytest.mark.parametrize("channels", [False, True], ids=["scalar", "channel"])
def test_chunk_local_cumsum_restarts_at_chunks_and_sequences(channels):
    gen = torch.Generator().manual_seed(2)
    lengths, C = [21, 1, 0, 8, 16], 8
    cu = torch.tensor([0, *accumulate(lengths)])
    g = torch.randn(1, sum(lengths), 3, *([4] if channels else []), generator=gen, dtype=F64)
    gc = chunk_local_cumsum(g, C, cu, scale=math.log2(math.e))
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for t in range(bos, eos):
            start = bos + (t - bos) // C * C
            torch.testing.assert_close(gc[0, t], g[0, start:t + 1].sum(0) * math.log2(math.e), rtol=0, atol=1e-14)


def explicit_kkt_rows(k, beta, gc, C, bos, eos, h_k, h):
    """Rows bos:eos of the kkt_solve output for value head h, built entry by entry and inverted by torch."""
    out = torch.zeros(eos - bos, C, dtype=F64)
    for c0 in range(bos, eos, C):
        L = min(C, eos - c0)
        M = torch.eye(L, dtype=F64)
        for i in range(L):
            for j in range(i):
                decay = torch.exp(gc[c0 + i] - gc[c0 + j])
                M[i, j] = beta[c0 + i] * (k[c0 + i, h_k] * k[c0 + j, h_k] * decay).sum()
        out[c0 - bos:c0 - bos + L, :L] = torch.linalg.inv(M)
    return out


@pytest.mark.parametrize("inverse", ["solve", *INVERSE_METHODS])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("C", [16, 64])
def test_kkt_solve_matches_explicit_inverse(C, gate, inverse):
    """Partial chunks, a length-0/1 sequence, GVA; at C = 64 the g = -20 head makes gc reach -800 in a chunk."""
    lengths, H, G, K = [40, 1, 0, 16], 1, 3, 8
    p = make_problem(gate, True, lengths, H=H, G=G, K=K)
    gc = None if p["g"] is None else chunk_local_cumsum(p["g"], C, p["cu_seqlens"])
    A = kkt_solve(p["k"], p["beta"], gc, chunk_size=C, cu_seqlens=p["cu_seqlens"], inverse=inverse)
    cu = p["cu_seqlens"].tolist()
    for h in range(H * G):
        head_gc = torch.zeros(sum(lengths), 1, dtype=F64) if gc is None else gc[0, :, h].reshape(sum(lengths), -1)
        for bos, eos in zip(cu[:-1], cu[1:]):
            expected = explicit_kkt_rows(p["k"][0], p["beta"][0, :, h], head_gc, C, bos, eos, h // G, h)
            torch.testing.assert_close(A[0, bos:eos, h], expected, rtol=0, atol=1e-13)


@pytest.mark.parametrize("gate", GATES)
def test_kkt_solve_beta_columns_scale_each_column_by_its_token(gate):
    """beta_columns: A diag(beta), column j of a row times beta of its chunk's token j (partial chunks, length-0/1
    sequences, GVA)."""
    lengths, C = [40, 1, 0, 16, 70], 16
    p = make_problem(gate, True, lengths, H=1, G=3, K=8)
    gc = None if p["g"] is None else chunk_local_cumsum(p["g"], C, p["cu_seqlens"])
    A = kkt_solve(p["k"], p["beta"], gc, chunk_size=C, cu_seqlens=p["cu_seqlens"])
    Ab = kkt_solve(p["k"], p["beta"], gc, chunk_size=C, cu_seqlens=p["cu_seqlens"], beta_columns=True)
    cu = p["cu_seqlens"].tolist()
    for bos, eos in zip(cu[:-1], cu[1:]):
        for c0 in range(bos, eos, C):
            c1 = min(c0 + C, eos)
            beta = p["beta"][0, c0:c1].transpose(0, 1)  # [HV, L]: column j of every row takes token c0 + j's
            torch.testing.assert_close(Ab[0, c0:c1, :, : c1 - c0], A[0, c0:c1, :, : c1 - c0] * beta[None],
                                       rtol=0, atol=1e-15)
            assert not Ab[0, c0:c1, :, c1 - c0:].any()


def realistic_L(C, gated, batch=3, K=32, seed=3):
    """I + strictLower(diag(beta) (Gamma ⊙ K K^T)) with l2-normalised k, beta in (0, 1), optional channel gate."""
    gen = torch.Generator().manual_seed(seed + C)
    k = F.normalize(torch.randn(batch, C, K, generator=gen, dtype=F64), dim=-1)
    beta = torch.rand(batch, C, 1, generator=gen, dtype=F64)
    g = F.logsigmoid(3 + torch.randn(batch, C, K, generator=gen, dtype=F64))  # ~ -0.05 per token: A stays dense
    gc = g.cumsum(1) if gated else torch.zeros(batch, C, K, dtype=F64)
    decay = torch.exp((gc[:, :, None] - gc[:, None]).clamp(max=0))  # the upper half is masked out below
    return torch.eye(C, dtype=F64) + (beta * torch.einsum("bid,bjd,bijd->bij", k, k, decay)).tril(-1)


@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("C", [16, 32, 64, 128])
@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_inverse_matches_torch_inv(method, C, gated):
    L = realistic_L(C, gated)
    if method == "neumann":
        X = neumann_inverse_16(L) if C == 16 else blocked_inverse(L, base_inverse=neumann_inverse_16)
    else:
        X = INVERSE_FNS[method](L)
    torch.testing.assert_close(X, torch.linalg.inv(L), rtol=0, atol=1e-13)


@pytest.mark.parametrize("inverse", INVERSE_METHODS)
def test_beta_zero_gives_identity(inverse):
    p = make_problem("channel", True, [40, 1, 23], K=8)
    gc = chunk_local_cumsum(p["g"], 32, p["cu_seqlens"])
    A = kkt_solve(p["k"], torch.zeros_like(p["beta"]), gc, chunk_size=32, cu_seqlens=p["cu_seqlens"],
                  inverse=inverse)
    for bos, eos in zip(p["cu_seqlens"][:-1].tolist(), p["cu_seqlens"][1:].tolist()):
        for c0 in range(bos, eos, 32):
            L = min(32, eos - c0)
            expected = torch.eye(L, 32, dtype=F64).expand(A.shape[2], L, 32).transpose(0, 1)
            assert torch.equal(A[0, c0:c0 + L], expected)


@pytest.mark.parametrize("C", [32, 64])
@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_off_diagonal_block_only_gives_minus_L10(method, C):
    h = C // 2
    L10 = torch.randn(2, h, h, generator=torch.Generator().manual_seed(4), dtype=F64)
    L = torch.eye(C, dtype=F64).repeat(2, 1, 1)
    L[:, h:, :h] = L10
    X = blocked_inverse(L, base_inverse=neumann_inverse_16) if method == "neumann" else INVERSE_FNS[method](L)
    assert torch.equal(X[:, h:, :h], -L10)
    assert torch.equal(X[:, :h, :h], torch.eye(h, dtype=F64).expand(2, h, h))


def test_neumann_fp16_error_level():
    L = realistic_L(16, gated=True, batch=64)
    error = (neumann_inverse_16(L, dtype=torch.float16) - torch.linalg.inv(L)).abs().max().item()
    assert 1e-5 < error < 1e-3  # fp16 rounding is visible, yet small


@pytest.mark.parametrize("method,C,fma,chain", [
    ("row", 32, 4960, 31), ("blocked", 32, 9312, 17),
    ("row", 64, 41664, 63), ("flat", 64, 67776, 21), ("blocked", 64, 84160, 19),
    ("flat", 128, None, 29), ("blocked", 128, 692608, 21),
    ("neumann", 16, 6 * 16 ** 3, 4),
])
def test_inverse_cost_reproduces_seed_tables(method, C, fma, chain):
    cost = inverse_cost(method, C)
    assert cost["chain"] == chain
    if fma is not None:
        assert cost["fma"] == fma
