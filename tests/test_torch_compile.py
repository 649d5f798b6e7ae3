"""torch.compile of modules that call the attention ops (the custom op tilela::chunk_attention): fullgraph, no
graph break, dense and varlen with cu_seqlens_cpu; a new varlen layout of the same shapes does not recompile, nor
(dynamic=True) a new token and sequence count; gradients flow through the compiled graph. On the CPU, and on a
Hopper GPU (``gpu``) in bf16 at K = V = 64, where the op runs the TileLang kernels."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tilela

H, HV = 2, 4
# device: (K = V, dtype); on the GPU sizes and dtype the Hopper kernels serve
SETUP = {"cpu": (16, torch.float32), "cuda": (64, torch.bfloat16)}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def inputs(T, seed=0, device="cpu"):
    K, dtype = SETUP[device]
    V = K
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
             v=torch.randn(1, T, HV, V, generator=gen), a=torch.randn(1, T, HV, generator=gen),
             b=torch.randn(1, T, HV, generator=gen), A_log=torch.randn(HV, generator=gen) * 0.3,
             dt_bias=torch.randn(HV, generator=gen))
    return {n: t.to(device, dtype if n in "qkv" else torch.float32) for n, t in x.items()}


def gdn(x, cu=None, cu_cpu=None):
    """Qwen3-Next's call with FLA's options in the kernel: l2norm, beta sigmoid, the gate from A_log and dt_bias."""
    o, S = tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                         cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, use_gate_in_kernel=True,
                                         A_log=x["A_log"], dt_bias=x["dt_bias"])
    return o * 2, S


def linear(x, cu=None, cu_cpu=None):
    o, (S, z) = tilela.chunk_linear_attn(x["q"].abs(), x["k"].abs(), x["v"], None, None, True, cu_seqlens=cu,
                                         cu_seqlens_cpu=cu_cpu)
    return o, S, z


def cu_of(lengths, device="cpu"):
    cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return cpu.to(device), cpu


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _same(got, want):
    for a, b in zip(got, want):
        tol = 1e-5 if a.dtype in (torch.float32, torch.float64) else 2e-2  # inductor may fuse bf16 roundings away
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [gdn, linear])
def test_dense_fullgraph_inductor(fn, device):
    x = inputs(100, device=device)
    x = {n: t.view(2, 50, *t.shape[2:]) if t.dim() > 1 else t for n, t in x.items()}
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    _same(compiled(x), fn(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [gdn, linear])
def test_new_varlen_layout_does_not_recompile(fn, device):
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    x = inputs(120, device=device)
    for lengths in ((50, 70), (1, 119), (0, 120)):  # same token count, other boundaries
        cu, cu_cpu = cu_of(lengths, device)
        _same(compiled(x, cu, cu_cpu), fn(x, cu, cu_cpu))
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [gdn, linear])
def test_dynamic_token_and_sequence_counts_do_not_recompile(fn, device):
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter, dynamic=True)
    for seed, lengths in enumerate(((50, 70), (3, 40, 17), (9, 9, 9, 30, 2), (64, 1, 100, 7))):
        x = inputs(sum(lengths), seed, device)
        cu, cu_cpu = cu_of(lengths, device)
        _same(compiled(x, cu, cu_cpu), fn(x, cu, cu_cpu))
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_backward_through_the_compiled_graph(device):
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(gdn, fullgraph=True, backend=counter)
    grads = []
    for run in (gdn, compiled):
        x = {n: t.clone().requires_grad_() for n, t in inputs(90, device=device).items()}
        cu, cu_cpu = cu_of((30, 60), device)
        o, S = run(x, cu, cu_cpu)
        (o.square().sum() + S.sum()).backward()
        grads.append([x[n].grad for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")])
    _same(grads[1], grads[0])
    assert counter.frame_count == 1


def test_the_op_and_its_fake_give_the_same_shapes():
    x = inputs(30)
    cu, cu_cpu = cu_of((10, 0, 20))
    args = (x["q"], x["k"], x["v"], x["a"], torch.sigmoid(x["b"]), None, cu, cu_cpu, "scalar", True, None, True)
    torch.library.opcheck(torch.ops.tilela.chunk_attention.default, args)


def test_l2norm_in_a_compiled_graph_takes_the_traceable_form(monkeypatch):
    """use_qk_l2norm_in_kernel inside a compiled graph runs the PyTorch l2norm, not the Hopper kernel (the tracer
    cannot enter its compile and launch): a stand-in backend that serves l2norm and raises when called shows the
    compiled call never reaches it; the attention itself takes the PyTorch path (the stand-in covers nothing)."""
    from types import SimpleNamespace

    from tilela import ops

    x = inputs(60)
    want = gdn(x)

    def kernel(*_):
        raise AssertionError("the l2norm kernel was called in a compiled graph")

    backend = SimpleNamespace(DTYPE_NAMES={}, l2_normalize=kernel,
                              plan=SimpleNamespace(l2norm_covers=lambda *_: True, covers=lambda *_: False))
    monkeypatch.setattr(ops, "_hopper", lambda *tensors: backend)
    _same(torch.compile(gdn, fullgraph=True, backend="aot_eager")(x), want)
