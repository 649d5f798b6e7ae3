"""Sequence split of the state/output pass: the segments of long sequences run in parallel CTAs (intra-card context
parallelism, done exactly). Mirrors reference layer E (reference.seq_split):

    over a segment of chunks the pass is affine in its entering state:  S_out = M S_in + B
  1. transitions  the state pass alone (no output) over every segment, with the value extended to [V | 0] and the
                  entering state to [0 | I] (a K x (V + K) state): its final state is [B | M]. Without the delta
                  rule M = exp(sum of g over the segment) I, a scalar per segment and head (1 without a gate), so
                  the pass runs on V from a zero state for B alone
  2. entering     S_in(0) = the sequence's initial state (or 0), S_in(j + 1) = M_j S_in(j) + B_j, fp32, one batched
                  product (or scaling) per segment index over all sequences and heads
  3. outputs      the state/output pass over the segments as one varlen batch from the entering states; a sequence's
                  final state is that of its last segment

Segments begin at chunk boundaries of their sequence, so the chunk-local gc and A are those of the unsplit call. An
empty sequence keeps one empty segment (its final state is its initial state). Every table is built on the device
from cu_seqlens and host sizes only (SegmentPlan), so nothing synchronises with the host.

The passes are given as `state_pass(q, k, v, g_cumsum, beta, A, scale, h0, cu_seqlens, store_output,
store_final_state) -> (o, ht)` (varlen layout, initial state in): the TileLang pass on the GPU, any other
implementation of the same contract elsewhere. The transitions' pass leaves o unwritten (its buffer is still
allocated: the kernel's launch contract fixes o's shape). The combine runs torch.baddbmm in fp32, so it honours a
caller's TF32 setting (PyTorch's default keeps it off).
"""

import math
from dataclasses import dataclass

import torch

from .. import TILE as CHUNK
from .chunk_fwd_ws import default_block_DV


@dataclass(frozen=True)
class SegmentPlan:
    """Host sizes of a split: segment_chunks chunks per segment (a sequence's last segment may be shorter),
    num_segments over all sequences, max_per_sequence of any one sequence."""

    segment_chunks: int
    num_segments: int
    max_per_sequence: int

    @classmethod
    def of(cls, lengths, segment_chunks: int) -> "SegmentPlan":
        if segment_chunks < 1:
            raise ValueError(f"segment_chunks: expected >= 1, got {segment_chunks}")
        counts = [max(1, math.ceil(n / (CHUNK * segment_chunks))) for n in lengths]
        return cls(segment_chunks, sum(counts), max(counts, default=1))


# Cost model of the split (ms), from the H200 measurements in benchmarks/NOTES.md (2026-11-30): one chunk of the
# warp-specialised pass costs a CTA ~2.5 us at DV blocks of K / 2 and ~3.6 us at K, whatever the grid (the pass is
# bound by each CTA's serial chunk chain; one CTA per SM). The combine step is a guess (five small kernels).
CHUNK_MS = {"half": 2.5e-3, "full": 3.6e-3}
COMBINE_STEP_MS = 1.5e-2
SEGMENT_CHUNKS = (8, 16, 32, 64, 128, 256)


def _pass_ms(K: int, V: int, grid: int, chunks: int, sms: int) -> float:
    block = default_block_DV(K, V, grid)
    return math.ceil(grid * (V // block) / sms) * chunks * CHUNK_MS["full" if block == K else "half"]


def modelled_ms(lengths, heads: int, sms: int, plan: SegmentPlan | None, K: int = 128, delta: bool = True) -> float:
    """Modelled time of the state/output pass unsplit (plan None) or split: transitions (value [V | 0] with the
    delta rule, V without), combine steps and outputs, each pass as waves of CTAs times the longest chain of
    chunks."""
    longest = max((math.ceil(n / CHUNK) for n in lengths), default=0)
    if plan is None:
        return _pass_ms(K, K, len(lengths) * heads, longest, sms)
    chain = min(plan.segment_chunks, longest)
    grid = plan.num_segments * heads
    return (_pass_ms(K, 2 * K if delta else K, grid, chain, sms) + _pass_ms(K, K, grid, chain, sms)
            + plan.max_per_sequence * COMBINE_STEP_MS)


def auto_plan(lengths, heads: int, sms: int, K: int = 128, delta: bool = True,
              margin: float = 0.8) -> SegmentPlan | None:
    """The segment size (from SEGMENT_CHUNKS) whose modelled time is lowest, if it beats the unsplit pass's by the
    margin; else None (tilela.ops asks it for every call the warp-specialised pass covers)."""
    longest = max((math.ceil(n / CHUNK) for n in lengths), default=0)
    best, best_ms = None, margin * modelled_ms(lengths, heads, sms, None, K, delta)
    for segment_chunks in SEGMENT_CHUNKS:
        if segment_chunks >= longest:
            break
        plan = SegmentPlan.of(lengths, segment_chunks)
        ms = modelled_ms(lengths, heads, sms, plan, K, delta)
        if ms < best_ms:
            best, best_ms = plan, ms
    return best


def segment_table(cu_seqlens: torch.Tensor, plan: SegmentPlan):
    """(cu_segments int32 [S + 1], slot int64 [S], last int64 [N]) on cu_seqlens's device: the segments' token
    boundaries; segment s, the j-th of sequence n, at slot j * N + n of the combine's [P, N] grid
    (P = plan.max_per_sequence); each sequence's last segment."""
    cu = cu_seqlens.long()
    N = cu.shape[0] - 1
    tokens = CHUNK * plan.segment_chunks
    count = torch.clamp((cu[1:] - cu[:-1] + tokens - 1) // tokens, min=1)
    ends = torch.cumsum(count, 0)
    first = ends - count
    seg = torch.arange(plan.num_segments, device=cu.device)
    seq = torch.searchsorted(ends, seg, right=True)
    j = seg - first[seq]
    cu_segments = torch.cat([cu[seq] + j * tokens, cu[-1:]]).to(torch.int32)
    return cu_segments, j * N + seq, ends - 1


def split_forward(state_pass, q, k, v, g_cumsum, beta, A, scale, initial_state, output_final_state, cu_seqlens,
                  plan: SegmentPlan):
    """The state/output pass of the unsplit call ((o [B,T,HV,V], final state [N,HV,K,V] fp32 or None)), computed
    segment-parallel; arguments as kernels.hopper.chunk_fwd.chunk_forward. plan must be SegmentPlan.of(the
    call's sequence lengths): the device-side tables cannot check it without a host synchronisation.

    The combine walks the [P, N] slot grid: step j is one batched fp32 product over the N sequences and HV heads,
    S_in[j + 1] = M[j] S_in[j] + B[j] (a scaling without the delta rule); a sequence with fewer than P segments has
    M = B = 0 in its empty slots, whose entering states are never read."""
    B, Tn, HV, V = v.shape
    K = q.shape[-1]
    flat = lambda x: None if x is None else x.reshape(1, B * Tn, *x.shape[2:])  # noqa: E731
    q1, k1, v1, g1, beta1, A1 = map(flat, (q, k, v, g_cumsum, beta, A))
    if cu_seqlens is None:
        cu_seqlens = torch.arange(B + 1, device=v.device, dtype=torch.int32) * Tn
    N, P = cu_seqlens.shape[0] - 1, plan.max_per_sequence
    cu_seg, slot, last = segment_table(cu_seqlens, plan)

    batched = lambda x, j: x[j * N : (j + 1) * N].view(N * HV, *x.shape[2:])  # noqa: E731

    def slots(per_segment):  # [S, ...] -> [P * N, ...], zero in the empty slots
        return per_segment.new_zeros(P * N, *per_segment.shape[1:]).index_copy_(0, slot, per_segment)

    def entering(B_seg):  # slot grid of entering states, first row the initial states
        S_slot = torch.empty_like(slots(B_seg))
        S_slot[:N] = 0 if initial_state is None else initial_state
        return S_slot

    if A is None and beta is None:  # plain update: M is exp(the segment's log decay) I, B the pass from zero
        h_zero = torch.zeros(plan.num_segments, HV, K, V, device=v.device, dtype=torch.float32)
        _, B_seg = state_pass(q1, k1, v1, g1, beta1, A1, scale, h_zero, cu_seg, False, True)
        B_slot, S_slot = slots(B_seg), entering(B_seg)
        m_slot = slots(segment_decay(g1, cu_seg, plan.num_segments, HV).to(B_seg.dtype))
        for j in range(P - 1):
            torch.addcmul(batched(B_slot, j), batched(m_slot, j)[:, None, None], batched(S_slot, j),
                          out=batched(S_slot, j + 1))
    else:
        v_ext = torch.cat([v1, v1.new_zeros(1, B * Tn, HV, K)], dim=-1)
        h_ext = torch.zeros(plan.num_segments, HV, K, V + K, device=v.device, dtype=torch.float32)
        h_ext[..., V:] = torch.eye(K, device=v.device, dtype=torch.float32)
        _, BM = state_pass(q1, k1, v_ext, g1, beta1, A1, scale, h_ext, cu_seg, False, True)
        B_slot, M_slot, S_slot = slots(BM[..., :V]), slots(BM[..., V:]), entering(BM[..., :V])
        for j in range(P - 1):
            torch.baddbmm(batched(B_slot, j), batched(M_slot, j), batched(S_slot, j), out=batched(S_slot, j + 1))

    o, ht = state_pass(q1, k1, v1, g1, beta1, A1, scale, S_slot[slot], cu_seg, True, bool(output_final_state))
    final = ht[last] if output_final_state else None
    return o.view(B, Tn, HV, V), final


def segment_decay(g_cumsum, cu_segments: torch.Tensor, num_segments: int, HV: int) -> torch.Tensor:
    """exp(sum of the log gate over each segment) [S, HV] fp32, from the chunk-local cumsum [1, T, HV] (its value at
    each chunk's last token is the chunk's sum), or ones without a gate."""
    if g_cumsum is None:
        return torch.ones(num_segments, HV, device=cu_segments.device)
    Tn = g_cumsum.shape[1]
    cu = cu_segments.long()
    t = torch.arange(Tn, device=cu.device)
    seg = torch.searchsorted(cu[1:], t, right=True)
    chunk_end = ((t - cu[seg] + 1) % CHUNK == 0) | (t + 1 == cu[seg + 1])
    log_decay = g_cumsum.new_zeros(num_segments, HV, dtype=torch.float32)
    log_decay.index_add_(0, seg, torch.where(chunk_end[:, None], g_cumsum[0].float(), 0.0))
    return log_decay.exp()
