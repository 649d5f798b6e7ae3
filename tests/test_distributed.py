"""Context parallelism (tilela.distributed) on the CPU: 2 and 3 gloo processes each hold a contiguous share of a
varlen batch whose sequences straddle the rank boundaries (one of them over three ranks, an empty one, a rank holding
one token), with an initial state and GVA; each rank's outputs and the final states must equal one process's call
of the same op (fp32: rel L2 < 1e-5, float64: < 1e-10). All cases run in one spawn of three processes."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import tilela
from tilela import distributed as cp

H, HV, K, V = 2, 4, 16, 32
CU = {2: [0, 37, 37, 40, 90, 96], 3: [0, 5, 70, 96]}  # even split: 48 / 32 tokens per rank
UNEVEN = [0, 20, 21, 96]  # three ranks; rank 1 holds one token


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def problem(cu: list[int], dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(len(cu))
    T, N = cu[-1], len(cu) - 1
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=randn(1, T, H, K).to(dtype), k=F.normalize(randn(1, T, H, K), dim=-1).to(dtype),
                v=randn(1, T, HV, V).to(dtype), g=F.logsigmoid(randn(1, T, HV) + 2).to(dtype),
                gk=F.logsigmoid(randn(1, T, HV, K) + 3).to(dtype), beta=torch.sigmoid(randn(1, T, HV)).to(dtype),
                h0=randn(N, HV, K, V).to(dtype), gamma=-torch.rand(HV, generator=gen, dtype=torch.float64) * 0.1,
                cu=torch.tensor(cu))


def cases(x: dict) -> dict:
    """name -> (op, args, kwargs) of the single-process call; the context-parallel call gives the rank's tokens."""
    q, k, v, g, beta, h0 = x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"]
    state = dict(initial_state=h0, output_final_state=True)
    return {
        "gdn": (tilela.chunk_gated_delta_rule, (q, k, v, g, beta), state),
        "gdn_l2norm_v_first": (tilela.chunk_gated_delta_rule, (q, k, v, g, beta),
                               dict(initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, state_v_first=True)),
        "gdn_no_state": (tilela.chunk_gated_delta_rule, (q, k, v, g, beta), {}),  # the passes a rank can skip
        "gdn_final_only": (tilela.chunk_gated_delta_rule, (q, k, v, g, beta), dict(output_final_state=True)),
        "kda": (tilela.chunk_kda, (q, k, v, x["gk"], beta), state),
        "delta_rule": (tilela.chunk_delta_rule, (q, k, v[:, :, :H], beta[:, :, :H]),
                       dict(initial_state=h0[:, :H], output_final_state=True)),
        "simple_gla": (tilela.chunk_simple_gla, (q, k, v, g), dict(g_gamma=x["gamma"], **state)),
        "gla": (tilela.chunk_gla, (q, k, v[:, :, :H], x["gk"][:, :, :H]),
                dict(initial_state=h0[:, :H], output_final_state=True)),
        "linear_attn": (tilela.chunk_linear_attn, (q, k, v), dict(normalize=False, **state)),
    }


def shard(args: tuple, lo: int, hi: int) -> tuple:
    return tuple(a[:, lo:hi] for a in args)


def check_world(world: int, ctx: cp.CPContext, x: dict, tol: float) -> None:
    lo, hi = ctx.bounds[ctx.rank], ctx.bounds[ctx.rank + 1]
    for name, (op, args, kwargs) in cases(x).items():
        o_ref, S_ref = op(*args, cu_seqlens=x["cu"], **kwargs)
        if op in (tilela.chunk_gated_delta_rule, tilela.chunk_kda):
            o, S = op(*shard(args, lo, hi), cp_context=ctx, **kwargs)
        else:
            o, S = cp.cp_call(op, *shard(args, lo, hi), cp_context=ctx, **kwargs)
        assert (S is None) == (S_ref is None), name
        errors = rel(o, o_ref[:, lo:hi]), 0.0 if S is None else rel(S, S_ref)
        assert max(errors) < tol, (world, ctx.rank, ctx.bounds, name, errors)


def worker(rank: int, init: str) -> None:
    """Three ranks; the two-rank cases run on the subgroup of ranks 0 and 1 (the group argument)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        pair = dist.new_group([0, 1])
        for world, group in ((2, pair), (3, None)):
            if rank >= world:
                with pytest.raises(ValueError, match="not a member"):
                    cp.build_cp_context(torch.tensor(CU[world]), group)
                continue
            x32 = problem(CU[world], torch.float32)
            ctx = cp.build_cp_context(x32["cu"], group)
            check_world(world, ctx, x32, 1e-5)
            check_world(world, ctx, problem(CU[world], torch.float64), 1e-10)
        check_world(3, cp.build_cp_context(x32["cu"], bounds=UNEVEN), x32, 1e-5)
        assert (ctx.pre_num_ranks, ctx.post_num_ranks) == [(0, 2), (1, 1), (2, 0)][rank]
        assert ctx.cu_seqlens_cpu.tolist() == [[0, 5, 32], [0, 32], [0, 6, 32]][rank]
        check_rejections(ctx, x32)
    finally:
        dist.destroy_process_group()


def check_rejections(ctx: cp.CPContext, x: dict) -> None:
    lo, hi = ctx.bounds[ctx.rank], ctx.bounds[ctx.rank + 1]
    q, k, v = shard((x["q"], x["k"], x["v"]), lo, hi)
    bad = [
        (ValueError, "bounds", lambda: cp.build_cp_context(x["cu"], bounds=[0, 96])),
        (ValueError, "normalize", lambda: cp.cp_call(tilela.chunk_linear_attn, q, k, v, cp_context=ctx)),
        (ValueError, "cu_seqlens", lambda: cp.cp_call(tilela.chunk_linear_attn, q, k, v, normalize=False,
                                                      cu_seqlens=ctx.cu_seqlens, cp_context=ctx)),
        (ValueError, "v: expected this rank's", lambda: cp.cp_call(tilela.chunk_linear_attn, q, k, v[:, 1:],
                                                                   normalize=False, cp_context=ctx)),
        (TypeError, "op", lambda: cp.cp_call(tilela.kkt_solve, k, cp_context=ctx)),
        (ValueError, "q: requires grad", lambda: cp.cp_call(tilela.chunk_linear_attn, q.detach().requires_grad_(),
                                                            k, v, normalize=False, cp_context=ctx)),
    ]
    for error, word, call in bad:
        with pytest.raises(error, match=word):
            call()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_context_parallel_equals_one_process(tmp_path):
    mp.spawn(worker, args=(f"file://{tmp_path / 'rendezvous'}",), nprocs=3, join=True)


def test_cp_context_needs_an_initialised_group():
    with pytest.raises(ValueError, match="init_process_group"):
        cp.build_cp_context(torch.tensor([0, 8]))
