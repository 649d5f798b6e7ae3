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
empty sequence keeps one empty segment (its final state is its initial state). The segment tables come from the
plan's host lengths in one non-blocking copy (built on the device inside a CUDA-graph capture), so nothing
synchronises with the host.

The passes are given as `state_pass(q, k, v, g_cumsum, beta, A, scale, h0, cu_seqlens, store_output,
store_final_state) -> (o, ht)` (varlen layout, initial state in): the TileLang pass on the GPU, any other
implementation of the same contract elsewhere. The transitions' pass leaves o unwritten (its buffer is still
allocated: the kernel's launch contract fixes o's shape). The combine runs torch.baddbmm in fp32, so it honours a
caller's TF32 setting (PyTorch's default keeps it off).
"""

import functools
import math
from dataclasses import dataclass

import torch

from .. import TILE as CHUNK
from .chunk_fwd_ws import default_block_DV, modelled_us


# the gates the split takes: its transitions M are exp(segment decay) I (plain update) or read from [B | M] (delta
# rule); a per-channel gate's would be diagonal per key channel, which the combine does not implement
GATES = ("none", "scalar")


@dataclass(frozen=True)
class SegmentPlan:
    """A split of the sequences of the given host lengths: segment_chunks chunks per segment (a sequence's last
    segment may be shorter), num_segments over all sequences, max_per_sequence of any one sequence."""

    segment_chunks: int
    num_segments: int
    max_per_sequence: int
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, lengths, segment_chunks: int) -> "SegmentPlan":
        if segment_chunks < 1:
            raise ValueError(f"segment_chunks: expected >= 1, got {segment_chunks}")
        lengths = tuple(int(n) for n in lengths)
        counts = [max(1, math.ceil(n / (CHUNK * segment_chunks))) for n in lengths]
        return cls(segment_chunks, sum(counts), max(counts, default=1), lengths)


# Cost model of the split, on the warp-specialised pass's measured chunk periods (chunk_fwd_ws.CHUNK_US), plus what
# the split adds around its two launches: a fixed cost for its small copy and gather launches and one batched
# product per combine step. The H200's split times (benchmarks/NOTES.md, 2026-11-30) gave 0.11 ms fixed when the
# segment tables still took ~15 launches on the device; 0.07 ms is that fit less those launches, not yet measured.
SPLIT_FIXED_MS = 0.07
COMBINE_STEP_MS = 0.005
SEGMENT_CHUNKS = (8, 16, 32, 64, 128, 256)


def _pass_ms(K: int, V: int, grid: int, chunks: int, sms: int, store_output: bool) -> float:
    block = default_block_DV(K, V, grid, sms, store_output)
    return 1e-3 * modelled_us(K, V, grid, chunks, block, sms, store_output)


def modelled_ms(lengths, heads: int, sms: int, plan: SegmentPlan | None, K: int = 128, delta: bool = True) -> float:
    """Modelled time of the state/output pass unsplit (plan None) or split: transitions (the state alone, value
    [V | 0] with the delta rule, V without), combine steps, outputs and the split's fixed cost; each pass at the DV
    block chunk_fwd_ws.default_block_DV picks for it."""
    longest = max((math.ceil(n / CHUNK) for n in lengths), default=0)
    if plan is None:
        return _pass_ms(K, K, len(lengths) * heads, longest, sms, True)
    chain = min(plan.segment_chunks, longest)
    grid = plan.num_segments * heads
    return (_pass_ms(K, 2 * K if delta else K, grid, chain, sms, False) + _pass_ms(K, K, grid, chain, sms, True)
            + SPLIT_FIXED_MS + (plan.max_per_sequence - 1) * COMBINE_STEP_MS)


def auto_plan(lengths, heads: int, sms: int, K: int = 128, delta: bool = True,
              margin: float = 0.8) -> SegmentPlan | None:
    """The segment size (from SEGMENT_CHUNKS) whose modelled time is lowest, if it beats the unsplit pass's by the
    margin; else None (tilela.ops asks it for every call the warp-specialised pass covers but chunk_gla's, whose
    per-channel transitions the split does not take). The margin covers what
    the model leaves out: when the transitions fill the GPU several waves deep their chunk period grows (shared
    bandwidth). With margin 0.8 and the chunk periods of chunk_fwd_ws.CHUNK_US the model agrees with every split
    and unsplit pass the H200 has timed (benchmarks/NOTES.md, 2026-11-30)."""
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


def segment_table(cu_seqlens: torch.Tensor | None, plan: SegmentPlan, device: torch.device):
    """(cu_segments int32 [S + 1], slot int64 [S], last int64 [N]) on the device: the segments' token boundaries;
    segment s, the j-th of sequence n, at slot j * N + n of the combine's [P, N] grid (P = plan.max_per_sequence);
    each sequence's last segment. cu_seqlens: the call's boundaries (None for a dense batch).

    On a GPU the table comes from plan.lengths in one non-blocking copy from pinned memory (cached per plan and
    device), except while a CUDA graph is being captured: then it is computed from cu_seqlens on the device, so
    the graph owns every table it reads."""
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        return _pinned_table(plan, device, torch.cuda.current_stream(device).cuda_stream)
    if cu_seqlens is None:  # a dense batch: equal lengths (built on the device: no host copy inside a capture)
        cu_seqlens = torch.arange(len(plan.lengths) + 1, device=device) * plan.lengths[0]
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


def host_table(plan: SegmentPlan) -> tuple[list[int], list[int], list[int]]:
    """segment_table's three tables as host lists, from plan.lengths."""
    tokens, N = CHUNK * plan.segment_chunks, len(plan.lengths)
    starts, slots, last, bos = [], [], [], 0
    for n, length in enumerate(plan.lengths):
        count = max(1, math.ceil(length / tokens))
        starts += [bos + j * tokens for j in range(count)]
        slots += [j * N + n for j in range(count)]
        last.append(len(slots) - 1)
        bos += length
    return starts + [bos], slots, last


@functools.lru_cache(maxsize=64)
def _pinned_table(plan: SegmentPlan, device: torch.device, stream: int):
    """host_table on the device, per plan, device and stream (the copy is ordered on the stream that reads it)."""
    cu_segments, slots, last = host_table(plan)
    table = torch.tensor(cu_segments + slots + last, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    S = plan.num_segments
    return table[: S + 1].to(torch.int32), table[S + 1 : 2 * S + 1], table[2 * S + 1 :]


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
    N, P = len(plan.lengths), plan.max_per_sequence
    cu_seg, slot, last = segment_table(cu_seqlens, plan, v.device)

    batched = lambda x, j: x[j * N : (j + 1) * N].view(N * HV, K, x.shape[-1])  # noqa: E731
    if A is None:  # plain update: M is exp(the segment's log decay) I, B the pass from zero
        h_zero = torch.zeros(plan.num_segments, HV, K, V, device=v.device, dtype=torch.float32)
        _, B_seg = state_pass(q1, k1, v1, g1, beta1, A1, scale, h_zero, cu_seg, False, True)
        B_slot = B_seg.new_zeros(P * N, HV, K, V).index_copy_(0, slot, B_seg)
        decay = segment_decay(g1, cu_seg, plan.num_segments, HV).to(B_seg.dtype)
        m_slot = decay.new_zeros(P * N, HV).index_copy_(0, slot, decay).view(P * N * HV, 1, 1)
        S_slot = torch.empty_like(B_slot)
    else:
        v_ext = torch.cat([v1, v1.new_zeros(1, B * Tn, HV, K)], dim=-1)
        h_ext = torch.zeros(plan.num_segments, HV, K, V + K, device=v.device, dtype=torch.float32)
        h_ext[..., V:].diagonal(dim1=-2, dim2=-1).fill_(1.0)
        _, BM = state_pass(q1, k1, v_ext, g1, beta1, A1, scale, h_ext, cu_seg, False, True)
        BM_slot = BM.new_zeros(P * N, HV, K, V + K).index_copy_(0, slot, BM)
        B_slot, M_slot = BM_slot[..., :V], BM_slot[..., V:]
        S_slot = B_slot.new_empty(P * N, HV, K, V)
    S_slot[:N] = 0 if initial_state is None else initial_state
    for j in range(P - 1):
        if A is None:
            torch.addcmul(batched(B_slot, j), m_slot[j * N * HV : (j + 1) * N * HV], batched(S_slot, j),
                          out=batched(S_slot, j + 1))
        else:
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
