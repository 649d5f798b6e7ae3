"""chunk_local_cumsum and kkt_solve kernels on a Hopper GPU against the float64 reference stack.

Realistic inputs (l2-normalised k, beta in (0, 1), gates from none to strong decay), dense batches and varlen
layouts with short tails and length-1 sequences, GVA ratios 1 to 4 (odd ratios take the one-head-per-pass
kernel), K = 64 / 128 / 256, and the per-key-channel gate (KDA); plus the two degenerate checks of seed 000 §4:
beta = 0 gives I, and a matrix whose only non-zero off-diagonal block is L_10 (or M_10) gives exactly -L_10
there.
"""

import math

import pytest
import torch

from tilela import reference
from tilela._gates import apply_gate
from tilela.bench import rel_l2

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

from tilela import chunk_local_cumsum, kkt_solve  # noqa: E402
from tilela.kernels import hopper  # noqa: E402
from tilela.kernels.hopper import KKT_METHODS, launch, plan  # noqa: E402

DEV = "cuda"
# rel L2 of A - I vs float64 (the exact diagonal would hide errors): output rounding alone gives 1.7e-3 (bf16)
# and 2e-4 (fp16); tf32 coupling products and the fp16 Neumann operands add a few 1e-4.
TOL = {torch.bfloat16: 4e-3, torch.float16: 1.5e-3}


def chunk_identity(B, T, HV, C, cu):
    """The identity of every chunk in kkt_solve's [B, T, HV, C] layout."""
    eye = torch.zeros(B, T, HV, C, dtype=torch.float64)
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    for b, bos, eos in bounds:
        for t in range(bos, eos):
            eye[b, t, :, (t - bos) % C] = 1
    return eye


def offdiag_err(A, ref, cu):
    eye = chunk_identity(*ref.shape, cu)
    return rel_l2(A.double().cpu() - eye, ref - eye)


def layout(kind, gen):
    """(B, T, cu_seqlens or None)."""
    if kind == "dense":
        return 2, 200, None
    if kind == "single":
        return 1, 1000, None
    lengths = [1, 63, 64, 65, 1, 130, 7, 200, 1, 33]  # short tails and length-1 sequences
    lengths += torch.randint(1, 300, (30,), generator=gen).tolist()  # 40 sequences: two rounds of locate_tile's search
    cu = torch.tensor([0] + lengths).cumsum(0)
    return 1, int(cu[-1]), cu


def raw_gate(B, T, HV, regime, gen):
    if regime == "none":
        return None
    if regime == "strong":  # exponents far below float32's range inside a chunk
        return torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=gen) - 2) * 4
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=gen)) / 16
    g[:, :, : max(HV // 4, 1)] = 0  # FlashQLA's benchmark gate: a quarter of the heads do not decay
    return g


def make_inputs(B, T, H, HV, K, dtype, gen):
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    return k, beta


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("kind", ["dense", "varlen"])
@pytest.mark.parametrize("channels", [None, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_local_cumsum(chunk, kind, channels, dtype):
    gen = torch.Generator().manual_seed(chunk + len(kind))
    B, T, cu = layout(kind, gen)
    shape = (B, T, 6) if channels is None else (B, T, 6, channels)
    g = torch.nn.functional.logsigmoid(torch.randn(shape, generator=gen)).to(dtype)
    for scale in (None, 1 / math.log(2)):
        out = chunk_local_cumsum(g.to(DEV), chunk, None if cu is None else cu.to(DEV), scale=scale)
        ref = reference.chunk_local_cumsum(g, chunk, cu, scale)
        assert out.dtype == torch.float32 and out.shape == g.shape
        assert rel_l2(out, ref) < 1e-6


# (H, HV, K): GVA 2 and 4 (two value heads per pass), 1 and 3 (one per pass), K = 64 / 128 / 256
HEADS = [(2, 4, 128), (3, 3, 64), (1, 3, 256), (2, 8, 128)]
KKT_CASES = [(c, m, gate, dtype, kind, HEADS[n % len(HEADS)])
             for n, (c, m, gate, dtype, kind) in enumerate(
                 (c, m, gate, dtype, kind) for c, m in KKT_METHODS for gate in ("none", "weak", "strong")
                 for dtype in (torch.bfloat16, torch.float16) for kind in ("dense", "varlen"))]


@pytest.mark.parametrize("chunk,method,gate,dtype,kind,heads", KKT_CASES)
def test_kkt_solve(chunk, method, gate, dtype, kind, heads):
    gen = torch.Generator().manual_seed(chunk * 7 + len(gate) + len(kind))
    B, T, cu = layout(kind, gen)
    H, HV, K = heads
    k, beta = make_inputs(B, T, H, HV, K, dtype, gen)
    g = raw_gate(B, T, HV, gate, gen)
    gc = None if g is None else reference.chunk_local_cumsum(g, chunk, cu).float()
    A = kkt_solve(k.to(DEV), beta.to(DEV), None if gc is None else gc.to(DEV), chunk,
                  None if cu is None else cu.to(DEV), method=method)
    ref = reference.kkt_solve(k, beta, gc, chunk, cu)
    assert A.dtype == dtype and A.shape == (B, T, HV, chunk)
    assert torch.isfinite(A).all()
    assert offdiag_err(A, ref, cu) < TOL[dtype]


# per-key-channel gate (KDA): every chunk / method, bf16 and fp16, dense and varlen, GVA 2 (one value head per pass);
# the two value heads in turn in one CTA (dense) or side by side (varlen)
CHANNEL_CASES = [(c, m, dtype, kind) for c, m in KKT_METHODS for dtype in (torch.bfloat16, torch.float16)
                 for kind in ("dense", "varlen")]


@pytest.mark.parametrize("chunk,method,dtype,kind", CHANNEL_CASES)
def test_kkt_solve_per_channel_gate(chunk, method, dtype, kind):
    """KDA-like gate: logsigmoid per key channel, per-token values down to -5 (a channel can decay by e^-80 in 16
    tokens, the kernel's exactness bound), a quarter of the channels without decay."""
    gen = torch.Generator().manual_seed(chunk * 11 + len(kind))
    B, T, cu = layout(kind, gen)
    H, HV, K = 2, 4, 128
    k, beta = make_inputs(B, T, H, HV, K, dtype, gen)
    g = torch.nn.functional.logsigmoid(2 * torch.randn(B, T, HV, K, generator=gen) - 1).clamp_min(-5)
    g[..., : K // 4] = 0
    gc = reference.chunk_local_cumsum(g, chunk, cu).float()
    # the public op takes a scalar gate only; the per-channel kernel runs in chunk_kda's pipeline, so its launcher
    key = plan.kkt_key(chunk, method, hopper.DTYPE_NAMES[dtype], "channel", HV // H)
    k_dev = k.to(DEV)
    A, _ = launch.launch_kkt(key, k_dev, beta.to(DEV), gc.to(DEV),
                             launch.Schedule.of(k_dev, None if cu is None else cu.to(DEV)), 2 if cu is None else 1)
    ref = reference.kkt_solve(k, beta, gc, chunk, cu)
    assert A.dtype == dtype and A.shape == (B, T, HV, chunk)
    assert torch.isfinite(A).all()
    assert offdiag_err(A, ref, cu) < TOL[dtype]


@pytest.mark.parametrize("g_dtype,form", [(torch.float32, "log"), (torch.bfloat16, "log"), (torch.bfloat16, "sigmoid"),
                                          (torch.float16, "sigmoid"), (torch.bfloat16, "softplus")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [64, 128])
def test_gla_factors_A_from_the_raw_gate(g_dtype, form, dtype, K):
    """KDA's plan on the warp-specialised pass: gla_factors forms A from its own scores, summing the raw gate in its
    tile (the log gate, the bounded sigmoid form from its input with lower bound -5, or the softplus form), and
    writes Ab = A diag(beta); varlen with 1-token sequences, GVA 2, both score paths (calm channels, which decay by
    at most e^-160 over a tile, beside wild ones that decay by more; with the softplus form, about -13 per token on
    every other 16 tokens, every channel wild); against the float64 stack from the same gate, the diagonal
    (beta itself) apart."""
    gen = torch.Generator().manual_seed(len(form) + (g_dtype == torch.bfloat16) + K)
    B, T, cu = layout("varlen", gen)
    H, HV = 2, 4
    k, beta = make_inputs(B, T, H, HV, K, dtype, gen)
    params, lower = None, None
    if form == "log":
        raw = torch.nn.functional.logsigmoid(2 * torch.randn(B, T, HV, K, generator=gen) - 1).clamp_min(-5)
        raw[..., : K // 4] = 0
        raw[..., ::3] *= 2  # a third of the channels steep (about e^-210 over a tile): wild beside calm ones
        raw = raw.to(g_dtype)
        g = raw.double()
    elif form == "sigmoid":
        raw = (4 * torch.randn(B, T, HV, K, generator=gen)).to(g_dtype)
        params = ((torch.rand(HV, 1, generator=gen) + 0.5).log(), torch.randn(HV, K, generator=gen))
        lower = -5.0
        g = apply_gate(raw.double(), form, *(p.double() for p in params), lower)
    else:
        raw = 4 * torch.randn(B, T, HV, K, generator=gen)
        raw[:, torch.arange(T) // 16 % 2 == 0] -= 16  # softplus(~-16) ~ 0: these tokens barely decay
        raw = raw.to(g_dtype)
        params = ((torch.rand(HV, 1, generator=gen) * 15 + 1).log(), torch.randn(HV, K, generator=gen))
        g = apply_gate(raw.double(), form, *(p.double() for p in params), None)
    key = (K, hopper.DTYPE_NAMES[dtype], (hopper.DTYPE_NAMES[g_dtype], form), True)
    k_dev = k.to(DEV)
    sched = launch.Schedule.of(k_dev, cu.to(DEV))
    *_, Ab, _ = launch.launch_factors(key, k_dev, k_dev, raw.to(DEV), beta.to(DEV), K**-0.5, sched,
                                      None if params is None else tuple(p.to(DEV) for p in params), lower)
    ref = reference.kkt_solve(k, beta, reference.chunk_local_cumsum(g, 64, cu), 64, cu, beta_columns=True)
    assert Ab.dtype == dtype and Ab.shape == (B, T, HV, 64)
    assert torch.isfinite(Ab).all()
    diagonal = chunk_identity(B, T, HV, 64, cu).bool()  # row t's own column: beta_t, rounded to the output dtype
    got = Ab.double().cpu()
    assert rel_l2(got[diagonal], ref[diagonal]) < TOL[dtype]
    assert rel_l2(got.masked_fill(diagonal, 0), ref.masked_fill(diagonal, 0)) < TOL[dtype]


@pytest.mark.parametrize("g_dtype,form", [(torch.float32, "log"), (torch.bfloat16, "log"), (torch.float16, "softplus"),
                                          (torch.float32, "softplus")])
@pytest.mark.parametrize("heads", [(2, 4), (1, 3)], ids=["pairs", "odd_group"])
def test_kkt_solve_sums_the_scalar_gate(g_dtype, form, heads):
    """GDN's kkt_solve from the raw scalar gate (plan.kkt's gate_in): its gc and A those of the cumsum stage
    followed by kkt_solve on gc (float32 sums of the same terms, here scanned by a warp, there in row order: equal
    to float32 rounding), and A against the float64 stack;
    varlen with 1-token sequences, GVA 2 (two value heads per pass) and 3 (one), the log gate and FLA's softplus
    in-kernel gate with its (a, b) per value head and a -30 reset token; the fused launch with its groups of value
    heads side by side, the stage's in turn (plan.kkt_group_steps' two choices)."""
    gen = torch.Generator().manual_seed(len(form) + heads[1])
    B, T, cu = layout("varlen", gen)
    (H, HV), K = heads, 128
    k, beta = make_inputs(B, T, H, HV, K, torch.bfloat16, gen)
    params = None
    if form == "log":
        raw = raw_gate(B, T, HV, "weak", gen)
        raw[:, T // 3] = -30.0
        g = raw.to(g_dtype).double()
    else:
        raw = 4 * torch.randn(B, T, HV, generator=gen)
        params = torch.stack(((torch.rand(HV, generator=gen) * 15 + 1).log(), torch.randn(HV, generator=gen)))
        g = apply_gate(raw.to(g_dtype).double(), form, *params.double(), None)
    raw = raw.to(g_dtype)
    k_dev, cu_dev = k.to(DEV), cu.to(DEV)
    sched = launch.Schedule.of(k_dev, cu_dev)
    dtype, gd = hopper.DTYPE_NAMES[torch.bfloat16], hopper.DTYPE_NAMES[g_dtype]
    p_dev = None if params is None else params.to(DEV)
    fused = plan.kkt_key(64, "blocked", dtype, "scalar", HV // H, (gd, form))
    A, gc = launch.launch_kkt(fused, k_dev, beta.to(DEV), raw.to(DEV), sched, 1, None, p_dev)  # groups side by side
    gc_stage = launch.launch_cumsum((64, gd, form), raw.to(DEV), sched, None, p_dev)
    stage = plan.kkt_key(64, "blocked", dtype, "scalar", HV // H)
    A_stage, _ = launch.launch_kkt(stage, k_dev, beta.to(DEV), gc_stage, sched, -(-HV // H // stage[4]))  # in turn
    torch.testing.assert_close(gc, gc_stage, rtol=1e-6, atol=1e-6)
    assert rel_l2(A, A_stage) < 1e-3
    ref = reference.kkt_solve(k, beta, reference.chunk_local_cumsum(g, 64, cu), 64, cu)
    assert offdiag_err(A, ref, cu) < TOL[torch.bfloat16]


@pytest.mark.parametrize("gate", ["none", "strong", "raw"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(2, 4, 128), (1, 3, 128), (2, 4, 64)], ids=["pairs", "odd_group", "k64"])
def test_kkt_solve_scaled(gate, dtype, heads):
    """Ab = A diag(beta), the warp-specialised pass's operand (plan.kkt's scaled): against the float64 stack's
    beta_columns, the diagonal (beta of row t's own token) and the rest apart, from gc (no gate, a strong one) and
    from GDN's raw log gate summed in the tile; varlen with 1-token sequences, two value heads per pass and one, K
    = 128 and 64."""
    gen = torch.Generator().manual_seed(len(gate) + heads[1] + heads[2])
    B, T, cu = layout("varlen", gen)
    H, HV, K = heads
    k, beta = make_inputs(B, T, H, HV, K, dtype, gen)
    g = raw_gate(B, T, HV, "strong" if gate == "raw" else gate, gen)
    gc = None if g is None else reference.chunk_local_cumsum(g, 64, cu).float()
    k_dev, cu_dev = k.to(DEV), cu.to(DEV)
    sched = launch.Schedule.of(k_dev, cu_dev)
    name = hopper.DTYPE_NAMES[dtype]
    gate_in = ("float32", "log") if gate == "raw" else None
    key = plan.kkt_key(64, "blocked", name, "none" if g is None else "scalar", HV // H, gate_in, scaled=True)
    g_dev = None if g is None else (g if gate == "raw" else gc).float().to(DEV)
    Ab, _ = launch.launch_kkt(key, k_dev, beta.to(DEV), g_dev, sched, -(-HV // H // key[4]))
    ref = reference.kkt_solve(k, beta, gc, 64, cu, beta_columns=True)
    assert Ab.dtype == dtype and Ab.shape == (B, T, HV, 64)
    assert torch.isfinite(Ab).all()
    diagonal = chunk_identity(B, T, HV, 64, cu).bool()
    got = Ab.double().cpu()
    assert rel_l2(got[diagonal], ref[diagonal]) < TOL[dtype]
    assert rel_l2(got.masked_fill(diagonal, 0), ref.masked_fill(diagonal, 0)) < TOL[dtype]


def test_kkt_solve_large_matches_reference():
    """A prefill-sized dense case: many tiles per head, GVA 2."""
    gen = torch.Generator().manual_seed(3)
    k, beta = make_inputs(1, 4096, 4, 8, 128, torch.bfloat16, gen)
    gc = reference.chunk_local_cumsum(raw_gate(1, 4096, 8, "weak", gen), 64).float()
    ref = reference.kkt_solve(k, beta, gc, 64)
    for method in ("blocked", "neumann"):
        A = kkt_solve(k.to(DEV), beta.to(DEV), gc.to(DEV), 64, None, method=method)
        assert offdiag_err(A, ref, None) < TOL[torch.bfloat16]


@pytest.mark.parametrize("chunk,method", KKT_METHODS)
def test_kkt_solve_beta_zero_gives_identity(chunk, method):
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 70, 71, 200])
    k, _ = make_inputs(1, 200, 2, 4, 128, torch.bfloat16, gen)
    A = kkt_solve(k.to(DEV), torch.zeros(1, 200, 4, device=DEV), None, chunk, cu.to(DEV), method=method).cpu()
    assert torch.equal(A.double(), chunk_identity(1, 200, 4, chunk, cu))


def _one_coupling_block(C, row_block, gen):
    """k of one chunk whose K K^T is I on the 16x16 diagonal blocks and zero off them except block
    (row_block, 0) = Q, a random orthogonal 16x16 matrix; every row of k is a unit vector."""
    Q, _ = torch.linalg.qr(torch.randn(16, 16, generator=gen, dtype=torch.float64))
    k = torch.zeros(C, 128, dtype=torch.float64)
    free = 16  # basis vectors e_16.. for the blocks that must be orthogonal to everything else
    for b in range(C // 16):
        rows = slice(16 * b, 16 * b + 16)
        if b == 0:
            k[rows, :16] = torch.eye(16)
        elif b == row_block:
            k[rows, :16] = Q
        else:
            k[rows, free:free + 16] = torch.eye(16)
            free += 16
    return k, Q


@pytest.mark.parametrize("chunk,method", [(c, m) for c, m in KKT_METHODS if c >= 32])
@pytest.mark.parametrize("row_block", [1, 2])
def test_kkt_solve_single_coupling_block_is_negated(chunk, method, row_block):
    if row_block * 16 >= chunk:
        pytest.skip("block outside the chunk")
    gen = torch.Generator().manual_seed(2)
    k, Q = _one_coupling_block(chunk, row_block, gen)
    beta = torch.rand(1, chunk, 2, generator=gen) * 0.9 + 0.05
    A = kkt_solve(k[None, :, None].to(torch.float16).to(DEV), beta.to(DEV), None, chunk, None, method=method)
    A = A[0].double().cpu()  # [C, 2, C]
    for h in range(2):
        L = torch.zeros(chunk, chunk, dtype=torch.float64)
        rows = slice(16 * row_block, 16 * row_block + 16)
        L[rows, :16] = beta[0, rows, h, None].double() * Q  # the only non-zero block of L
        expected = torch.eye(chunk, dtype=torch.float64) - L
        assert (A[:, h] - expected).abs().max().item() < 2e-3
