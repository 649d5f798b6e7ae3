"""Context parallelism across processes: one sequence (or a varlen batch) sharded along T over the ranks of a
``torch.distributed`` process group, exact against one process.

Rank r holds the contiguous packed tokens ``[bounds[r], bounds[r + 1])``; the sequences it meets are cut into
*pieces* (a sequence's tokens on one rank). Over a piece the state update is affine in its entering state,
``S_out = M S_in + B`` (reference.seq_split), and the op computes both from the rank's own tokens, since the state
recurrence acts on each value column alone: B is the final state from a zero state, M that of zero values from the
state I (K value columns). Without the delta rule M is diagonal (exp of the summed gate per key channel), so only
its diagonal travels. Then:

  1. summary   each rank: [B | M] per piece, [pieces, HV, K, V + K] (delta rule) or [B | diag M] [.., V + 1];
  2. exchange  ONE all_gather of the summaries (padded to the most pieces of any rank);
  3. combine   every rank, the same serial walk in token order: S_in(first piece) = the sequence's initial state
               (or 0), S_in(next) = M S_in + B, the final state after its last piece; batched over the sequences
               by piece index, so at most world-size steps;
  4. outputs   each rank: the op over its pieces from their entering states.

A rank skips the passes nothing reads: B where no later piece and no final state needs it, M where its pieces start
their sequences from a zero state, and step 4 where every piece enters from zero (the B pass's outputs are those).

Every rank returns its tokens' outputs and the same full final states ``[N, HV, K, V]`` (all sequences of the
batch, from the combine). The ops run per rank as usual, so tensors on CUDA with NCCL take the Hopper kernels where
the op does (the M pass has K value columns: the kernels' K = V case). Nothing in the combine depends on the decay
forgetting the past, so the split is exact for every gate, g = 0 included.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from . import _validation as V
from . import ops


@dataclass(frozen=True)
class CPContext:
    """How a packed batch is sharded along T over ``group``, seen from one rank (FLA's FLACPContext fields first).

    ``cu_seqlens``/``cu_seqlens_cpu``: the rank-local boundaries of its pieces (on the device of the global
    ``cu_seqlens``, and on the host). ``is_first_rank``/``pre_num_ranks``: whether the rank starts its first
    sequence / how many ranks before it hold that sequence; ``is_last_rank``/``post_num_ranks`` likewise for its
    last sequence and the ranks after it. ``conv1d_kernel_size`` and ``pre_num_conv_tokens`` (tokens of its first
    sequence before the rank) are kept for a caller's causal convolution. ``seq_bounds``: the global (bos, eos) of
    every sequence; ``bounds`` [world + 1]: rank r holds packed tokens bounds[r] .. bounds[r + 1] - 1."""

    group: object | None
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    is_first_rank: bool
    is_last_rank: bool
    pre_num_ranks: int
    post_num_ranks: int
    conv1d_kernel_size: int | None
    pre_num_conv_tokens: int
    rank: int
    seq_bounds: tuple[tuple[int, int], ...]
    bounds: tuple[int, ...]

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(sequence, first token, end token) of each piece rank ``rank`` holds, in token order."""
        lo, hi = self.bounds[rank], self.bounds[rank + 1]
        return [(n, max(b, lo), min(e, hi)) for n, (b, e) in enumerate(self.seq_bounds) if max(b, lo) < min(e, hi)]


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group: object | None = None,
    conv1d_kernel_size: int | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    bounds: list[int] | tuple[int, ...] | None = None,
) -> CPContext:
    """The context of this rank (FLA's ``build_cp_context``): ``cu_seqlens`` [N + 1] the global boundaries of the
    packed batch before the split; ``group`` the process group (None: the default group). By default rank r holds
    the r-th of ``world`` equal parts (the total must divide evenly), as FLA; ``bounds`` [world + 1] (0, increasing,
    ending at the total) gives any contiguous split instead."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised; call init_process_group first")
    V._expect_tensor("cu_seqlens", cu_seqlens)
    host = (cu_seqlens if cu_seqlens_cpu is None else V._expect_tensor("cu_seqlens_cpu", cu_seqlens_cpu)).cpu()
    if host.dim() != 1 or host.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-d tensor [N+1] with N >= 1, got shape {V._shape(host)}")
    seq_bounds = V.check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, 1, int(host[-1]))
    total, world, rank = seq_bounds[-1][1], dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    if bounds is None:
        if total % world:
            raise ValueError(f"cu_seqlens: an even split needs the {total} tokens to divide by the {world} ranks; "
                             f"pass bounds for another split")
        bounds = [r * (total // world) for r in range(world + 1)]
    bounds = tuple(int(b) for b in bounds)
    if (len(bounds) != world + 1 or bounds[0] != 0 or bounds[-1] != total
            or any(a >= b for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"bounds: expected {world + 1} increasing token offsets from 0 to {total} (every rank holds "
                         f"a token), got {list(bounds)}")
    if conv1d_kernel_size is not None and (isinstance(conv1d_kernel_size, bool)
                                           or not isinstance(conv1d_kernel_size, int) or conv1d_kernel_size < 1):
        raise ValueError(f"conv1d_kernel_size: expected a positive int or None, got {conv1d_kernel_size!r}")
    lo, hi = bounds[rank], bounds[rank + 1]
    owner = lambda t: max(r for r in range(world) if bounds[r] <= t)  # noqa: E731  (rank holding token t)
    first = next(b for b, e in seq_bounds if e > lo)
    last = [e for b, e in seq_bounds if b < hi][-1]
    local = [0]
    for b, e in seq_bounds:
        if max(b, lo) < min(e, hi):
            local.append(local[-1] + min(e, hi) - max(b, lo))
    local_cpu = torch.tensor(local, dtype=torch.int64)
    return CPContext(group=group, cu_seqlens=local_cpu.to(cu_seqlens.device), cu_seqlens_cpu=local_cpu,
                     is_first_rank=owner(first) == rank, is_last_rank=owner(last - 1) == rank,
                     pre_num_ranks=rank - owner(first), post_num_ranks=owner(last - 1) - rank,
                     conv1d_kernel_size=conv1d_kernel_size, pre_num_conv_tokens=lo - first, rank=rank,
                     seq_bounds=seq_bounds, bounds=bounds)


def _expect_context(ctx) -> CPContext:
    if not isinstance(ctx, CPContext):
        raise TypeError(f"cp_context: expected a tilela.distributed.CPContext (build_cp_context), "
                        f"got {type(ctx).__name__}")
    return ctx


LocalOp = Callable[[torch.Tensor, "torch.Tensor | None", bool], tuple[torch.Tensor, "torch.Tensor | None"]]


def context_parallel(local: LocalOp, ctx: CPContext, v: torch.Tensor, K: int, initial_state: torch.Tensor | None,
                     output_final_state: bool, delta: bool, inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 1-4 of the module docstring. ``local(v, initial_state, output_final_state)`` runs the op on this rank's
    tokens (v [1, T_local, HV, V'], states [pieces, HV, K, V'] in the [K, V] layout, the context's local
    cu_seqlens); ``initial_state`` [N, HV, K, V] (every sequence, the same on every rank) or None. ``inputs``: the
    call's tensors by name. Forward only: the exchange carries no gradient, so an input that requires grad (with
    grad mode on) raises."""
    _expect_context(ctx)
    if torch.is_grad_enabled():
        for name, x in inputs.items():
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise ValueError(f"{name}: requires grad, but cp_context runs the forward only (the exchange "
                                 f"carries no gradient); call under torch.no_grad() or detach it")
    v = V._expect_tensor("v", v)
    V._expect_rank("v", v, 4, "[1, T_local, HV, V]")
    span = ctx.bounds[ctx.rank + 1] - ctx.bounds[ctx.rank]
    if v.shape[:2] != (1, span):
        raise ValueError(f"v: expected this rank's {span} tokens as [1, {span}, HV, V], got {V._shape(v)}")
    HV, Vd, N = v.shape[2], v.shape[3], len(ctx.seq_bounds)
    if initial_state is not None:
        V._expect_tensor("initial_state", initial_state)
        V._expect_shape("initial_state", initial_state, (N, HV, K, Vd), "[N, HV, K, V] of the whole batch")
    world = len(ctx.bounds) - 1
    pieces = [ctx.pieces(r) for r in range(world)]
    table = [(n, r, i) for r in range(world) for i, (n, _, _) in enumerate(pieces[r])]
    index_in_seq: list[int] = []  # a sequence's pieces follow one another in the table (token order)
    for p, (n, _, _) in enumerate(table):
        index_in_seq.append(index_in_seq[-1] + 1 if p and table[p - 1][0] == n else 0)
    offset, mine = sum(len(p) for p in pieces[: ctx.rank]), range(len(pieces[ctx.rank]))
    # What this rank's pieces need: B when a later piece or the final state reads their exit state, M too unless
    # they enter from a zero state (a sequence's first piece without initial_state).
    feeds = [output_final_state or (p + 1 < len(table) and table[p + 1][0] == table[p][0])
             for p in range(offset, offset + len(mine))]
    zero_in = [index_in_seq[offset + i] == 0 and initial_state is None for i in mine]
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    o = B = M = None
    if any(feeds):
        o, B = local(v, None, True)
    if any(f and not z for f, z in zip(feeds, zero_in)):
        eye = torch.eye(K, dtype=dtype, device=v.device).expand(len(mine), HV, K, K)
        _, M = local(v.new_zeros(1, span, HV, K), eye.contiguous(), True)
    summary = v.new_zeros(max(len(p) for p in pieces), HV, K, Vd + (K if delta else 1), dtype=dtype)
    if B is not None:
        summary[: len(mine), ..., :Vd] = B
    if M is not None:
        summary[: len(mine), ..., Vd:] = M if delta else M.diagonal(dim1=-2, dim2=-1)[..., None]
    gathered = [torch.empty_like(summary) for _ in range(world)]
    dist.all_gather(gathered, summary, group=ctx.group)
    flat = torch.stack([gathered[r][i] for _, r, i in table])
    B_all, M_all = flat[..., :Vd], flat[..., Vd:]

    S = summary.new_zeros(N, HV, K, Vd) if initial_state is None else initial_state.to(dtype).clone()
    S_in = torch.empty_like(B_all)
    for j in range(max(index_in_seq) + 1):
        rows = [p for p, i in enumerate(index_in_seq) if i == j]
        at, seqs = (torch.tensor(x, device=v.device) for x in (rows, [table[p][0] for p in rows]))
        S_prev = S.index_select(0, seqs)
        S_in.index_copy_(0, at, S_prev)
        step = M_all[at] @ S_prev if delta else M_all[at] * S_prev
        S.index_copy_(0, seqs, step + B_all[at])

    if o is None or not all(zero_in):  # from zero entering states the B pass gave the outputs already
        o, _ = local(v, S_in[offset: offset + len(mine)].contiguous(), False)
    return o, (S if output_final_state else None)


_DELTA = {ops.chunk_gated_delta_rule: True, ops.chunk_kda: True, ops.chunk_delta_rule: True,
          ops.chunk_simple_gla: False, ops.chunk_gla: False, ops.chunk_linear_attn: False}


def cp_call(op: Callable, *args, cp_context: CPContext, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``op(*args, **kwargs)`` (any public attention op of tilela.ops) context-parallel over ``cp_context``: this
    rank's tokens in, its outputs and the full final states out (every rank the same). The op's own
    ``cu_seqlens``/``cu_seqlens_cpu`` are not given (the context's are used); states are in the [K, V] layout
    (state_v_first=False); chunk_linear_attn needs normalize=False (its normaliser's key sum is not exchanged)."""
    if op not in _DELTA:
        raise TypeError(f"op: expected one of tilela.ops' attention ops ({', '.join(f.__name__ for f in _DELTA)}), "
                        f"got {getattr(op, '__name__', type(op).__name__)}")
    bound = inspect.signature(op).bind(*args, **kwargs)
    given = {**bound.arguments, **bound.arguments.get("kwargs", {})}
    for name in ("cu_seqlens", "cu_seqlens_cpu", "cp_context"):
        if given.get(name) is not None:
            raise ValueError(f"{name}: expected None under cp_call (the context gives the sharding), "
                             f"got {given[name]!r}")
    for name in ("state_v_first", "transpose_state_layout"):
        if given.get(name, False) is not False:
            raise ValueError(f"{name}: expected False under cp_call (states are [K, V]), got {given[name]!r}")
    if op is ops.chunk_linear_attn and given.get("normalize", True) is not False:
        raise ValueError("normalize: chunk_linear_attn runs context-parallel with normalize=False only")
    V._expect_tensor("k", bound.arguments["k"])
    _expect_context(cp_context)
    call = {name: value for name, value in bound.arguments.items() if name != "kwargs"}
    call.update(bound.arguments.get("kwargs", {}), cu_seqlens=cp_context.cu_seqlens,
                cu_seqlens_cpu=cp_context.cu_seqlens_cpu)

    def local(v, h0, final):
        return op(**dict(call, v=v, initial_state=h0, output_final_state=final))

    return context_parallel(local, cp_context, call["v"], call["k"].shape[-1], call.get("initial_state"),
                            V.check_flag("output_final_state", call.get("output_final_state", False)), _DELTA[op],
                            call)
