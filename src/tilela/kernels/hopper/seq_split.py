"""Sequence split of the state/output pass: the segments of long sequences run in parallel CTAs (intra-card context
parallelism, done exactly). Mirrors reference layer E (reference.seq_split):

    over a segment of chunks the pass is affine in its entering state:  S_out = M S_in + B
  1. transitions  the state pass alone (no output) over every segment, with the value extended to [V | 0] and the
                  entering state to [0 | I] (a K x (V + K) state): its final state is [B | M]. Without the delta
                  rule M = exp(sum of g over the segment) I, a scalar per segment and head (1 without a gate), so
                  the pass runs on V from a zero state for B alone
  2. entering     S_in(0) = the sequence's initial state (or 0), S_in(j + 1) = M_j S_in(j) + B_j, fp32: under the
                  plain update one launch of seq_combine.py (per sequence and value head, serial over its
                  segments, m_j summed from the gate there; it also gives the final states); with the delta rule
                  one batched product per segment index over all sequences and heads (torch.baddbmm)
  3. outputs      the state/output pass over the segments as one varlen batch from the entering states; with the
                  delta rule a sequence's final state is that of its last segment

Segments begin at chunk boundaries of their sequence, so the chunk-local gc and A are those of the unsplit call. An
empty sequence keeps one empty segment (its final state is its initial state). The segment table comes from the
plan's host lengths in one non-blocking copy from pinned memory, so nothing synchronises with the host: under the
plain update the split is four launches (copy, transitions, combine, outputs). A CUDA graph captured after an eager
call of the same plan reads that call's copy and has three nodes; captured first, the copy is its fourth node.

The passes are given as `state_pass(q, k, v, g_cumsum, beta, A, scale, h0, cu_seqlens, store_output,
store_final_state) -> (o, ht)` (varlen layout, initial state in or None): the TileLang pass on the GPU, any other
implementation of the same contract elsewhere; the plain update's combine likewise (entering_states on the GPU,
reference.entering_states elsewhere). The transitions' pass leaves o unwritten (its buffer is still allocated: the
kernel's launch contract fixes o's shape). The delta rule's combine runs torch.baddbmm in fp32, so it honours a
caller's TF32 setting (PyTorch's default keeps it off).
"""

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import TILE as CHUNK
from .chunk_fwd_ws import default_block_DV, modelled_us, update_rule


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
# the split adds around its passes, by update rule (delta rule or not): a fixed cost (launches, the table's copy, the
# gaps between launches) and a cost per combine step (segments of the longest sequence). Delta rule: the H200's
# split times (benchmarks/NOTES.md, 2026-11-30) gave 0.11 ms fixed when the segment tables still took ~15 launches;
# 0.07 ms is that fit less those launches, and one batched product per step. Plain update: fitted to split passes of
# levels 1-2 at T 8192 and 32768 (NOTES, fifth session): the copy, the combine launch and the launch gaps; its steps
# are a pipelined multiply-add each. The sixth session's periods (split passes timed alone) keep it: with them the
# model's splits of levels 1-2 come within 1% of the measured best (NOTES), a CUDA graph's saved table copy
# included.
SPLIT_FIXED_MS = {True: 0.07, False: 0.015}
COMBINE_STEP_MS = {True: 0.005, False: 0.0005}
SEGMENT_CHUNKS = (8, 16, 32, 64, 128, 256)


def _pass_ms(K: int, V: int, grid: int, chunks: int, sms: int, store_output: bool, rule: str) -> float:
    block = default_block_DV(K, V, grid, sms, store_output, rule)
    return 1e-3 * modelled_us(K, V, grid, chunks, block, sms, store_output, rule)


def modelled_ms(lengths, heads: int, sms: int, plan: SegmentPlan | None, K: int = 128, gate: str = "scalar",
                delta: bool = True) -> float:
    """Modelled time of the state/output pass unsplit (plan None) or split: transitions (the state alone, value
    [V | 0] with the delta rule, V without), combine steps, outputs and the split's fixed cost; each pass at the DV
    block chunk_fwd_ws.default_block_DV picks for it, at the periods of the gate kind and update rule."""
    rule = update_rule(gate, delta)
    longest = max((math.ceil(n / CHUNK) for n in lengths), default=0)
    if plan is None:
        return _pass_ms(K, K, len(lengths) * heads, longest, sms, True, rule)
    chain = min(plan.segment_chunks, longest)
    grid = plan.num_segments * heads
    return (_pass_ms(K, 2 * K if delta else K, grid, chain, sms, False, rule)
            + _pass_ms(K, K, grid, chain, sms, True, rule)
            + SPLIT_FIXED_MS[delta] + (plan.max_per_sequence - 1) * COMBINE_STEP_MS[delta])


def auto_plan(lengths, heads: int, sms: int, K: int = 128, gate: str = "scalar", delta: bool = True,
              margin: float = 0.8) -> SegmentPlan | None:
    """The segment size (from SEGMENT_CHUNKS) whose modelled time is lowest, if it beats the unsplit pass's by the
    margin; else None (tilela.ops asks it for every call the warp-specialised pass covers but chunk_gla's, whose
    per-channel transitions the split does not take). The margin covers what
    the model leaves out: when the transitions fill the GPU several waves deep their chunk period grows (shared
    bandwidth). With margin 0.8 and the chunk periods of chunk_fwd_ws.CHUNK_US the model agrees with every split
    and unsplit pass the H200 has timed (benchmarks/NOTES.md, 2026-11-30 and fifth session)."""
    longest = max((math.ceil(n / CHUNK) for n in lengths), default=0)
    best, best_ms = None, margin * modelled_ms(lengths, heads, sms, None, K, gate, delta)
    for segment_chunks in SEGMENT_CHUNKS:
        if segment_chunks >= longest:
            break
        plan = SegmentPlan.of(lengths, segment_chunks)
        ms = modelled_ms(lengths, heads, sms, plan, K, gate, delta)
        if ms < best_ms:
            best, best_ms = plan, ms
    return best


class SegmentTable(NamedTuple):
    """A plan's segments as index tensors (int32): cu_segments [S + 1] the segments' token boundaries (the passes'
    varlen layout); first [N + 1]: sequence n's segments are first[n] to first[n + 1] - 1; slot [S]: segment s, the
    j-th of sequence n, at slot j * N + n of the delta rule's [P, N] combine grid (P = plan.max_per_sequence);
    last [N]: each sequence's last segment."""

    cu_segments: torch.Tensor
    first: torch.Tensor
    slot: torch.Tensor
    last: torch.Tensor


def host_table(plan: SegmentPlan) -> tuple[list[int], ...]:
    """The SegmentTable's four tensors as host lists, from plan.lengths."""
    tokens, N = CHUNK * plan.segment_chunks, len(plan.lengths)
    starts, first, slots, last, bos = [], [0], [], [], 0
    for n, length in enumerate(plan.lengths):
        count = max(1, math.ceil(length / tokens))
        starts += [bos + j * tokens for j in range(count)]
        slots += [j * N + n for j in range(count)]
        first.append(len(slots))
        last.append(len(slots) - 1)
        bos += length
    return starts + [bos], first, slots, last


def segment_table(plan: SegmentPlan, device: torch.device) -> SegmentTable:
    """The plan's SegmentTable on the device. On a GPU it comes in one non-blocking copy from pinned memory (cached
    per plan, device and stream), so nothing synchronises with the host. Inside a CUDA-graph capture the graph
    reads a copy made before the capture when there is one (torch.cuda.graph synchronises the device before it
    captures, so that copy has landed; it is then kept for good, as the graph reads it at every replay); else the
    copy is a node of the graph, reading the plan's pinned host table, which lives as long as the process."""
    if device.type != "cuda":
        return _views(_host_tensor(plan).to(device), plan)
    if torch.cuda.is_current_stream_capturing():
        return _captured_table(plan, device)
    return _device_table(plan, device, torch.cuda.current_stream(device).cuda_stream)


def _views(table: torch.Tensor, plan: SegmentPlan) -> SegmentTable:
    S, N = plan.num_segments, len(plan.lengths)
    return SegmentTable(*table.split([S + 1, N + 1, S, N]))


def _host_tensor(plan: SegmentPlan) -> torch.Tensor:
    """host_table in one int32 tensor."""
    return torch.tensor(sum(host_table(plan), []), dtype=torch.int32)


@functools.cache
def _pinned(plan: SegmentPlan) -> torch.Tensor:
    """_host_tensor pinned (never freed: a captured graph's copy reads it on every replay)."""
    return _host_tensor(plan).pin_memory()


def _copied(plan: SegmentPlan, device: torch.device) -> SegmentTable:
    """The table in one non-blocking copy from its pinned host tensor."""
    return _views(_pinned(plan).to(device, non_blocking=True), plan)


_EAGER_TABLES: dict[tuple[SegmentPlan, torch.device, int], SegmentTable] = {}  # insertion order: oldest first
_GRAPH_TABLES: dict[tuple[SegmentPlan, torch.device], SegmentTable] = {}
EAGER_TABLES = 64


def _device_table(plan: SegmentPlan, device: torch.device, stream: int) -> SegmentTable:
    """segment_table outside a capture, per plan, device and stream (the copy is ordered on the stream that reads
    it); the EAGER_TABLES latest are kept."""
    key = (plan, device, stream)
    table = _EAGER_TABLES.pop(key, None) or _copied(plan, device)
    _EAGER_TABLES[key] = table
    while len(_EAGER_TABLES) > EAGER_TABLES:
        del _EAGER_TABLES[next(iter(_EAGER_TABLES))]
    return table


def _captured_table(plan: SegmentPlan, device: torch.device) -> SegmentTable:
    """segment_table inside a capture: a copy made on the device before it (kept from then on), else a copy node."""
    table = _GRAPH_TABLES.get((plan, device))
    if table is None:
        table = next((t for (p, d, _), t in reversed(_EAGER_TABLES.items()) if (p, d) == (plan, device)), None)
        if table is None:
            return _copied(plan, device)
        _GRAPH_TABLES[(plan, device)] = table
    return table


def entering_states(B_seg, g_cumsum, cu_segments, first, h0):
    """Step 2 under the plain update on the GPU (seq_combine.py): (S_in [S, HV, K, V], final [N, HV, K, V]) fp32
    from the transitions' states B_seg [S, HV, K, V] fp32, the chunk-local cumsum of a scalar gate g_cumsum
    [1, T, HV] fp32 (or None), the table's cu_segments and first (int32) and h0 [N, HV, K, V] (or None)."""
    from . import _placeholder, compiled
    from .seq_combine import seq_combine_kernel

    S, HV, K, V = B_seg.shape
    S_in = torch.empty_like(B_seg)
    final = B_seg.new_empty(first.shape[0] - 1, HV, K, V)
    kernel = compiled(seq_combine_kernel, K, V, "none" if g_cumsum is None else "scalar", h0 is not None)
    kernel(B_seg, _placeholder(B_seg.device, torch.float32) if g_cumsum is None else g_cumsum, cu_segments, first,
           final if h0 is None else h0.float().contiguous(), S_in, final)
    return S_in, final


def split_forward(state_pass, combine, q, k, v, g_cumsum, beta, A, scale, initial_state, output_final_state,
                  plan: SegmentPlan):
    """The state/output pass of the unsplit call ((o [B,T,HV,V], final state [N,HV,K,V] fp32 or None)), computed
    segment-parallel; arguments as kernels.hopper.chunk_fwd.chunk_forward. plan must be SegmentPlan.of(the
    call's sequence lengths): the device-side tables cannot check it without a host synchronisation.

    Plain update: the transitions' pass from a zero state gives B, combine(B, g_cumsum, cu_segments, first, h0) ->
    (S_in, final) the entering and final states (entering_states on the GPU), the outputs'
    pass runs from S_in. Delta rule: the transitions' pass on [V | 0] from [0 | I] gives [B | M], and the combine
    walks the [P, N] slot grid: step j is one batched fp32 product over the N sequences and HV heads,
    S_in[j + 1] = M[j] S_in[j] + B[j]; a sequence with fewer than P segments has M = B = 0 in its empty slots,
    whose entering states are never read."""
    B, Tn, HV, V = v.shape
    K = q.shape[-1]
    flat = lambda x: None if x is None else x.reshape(1, B * Tn, *x.shape[2:])  # noqa: E731
    q1, k1, v1, g1, beta1, A1 = map(flat, (q, k, v, g_cumsum, beta, A))
    table = segment_table(plan, v.device)
    if A is None:
        _, B_seg = state_pass(q1, k1, v1, g1, beta1, A1, scale, None, table.cu_segments, False, True)
        S_in, final = combine(B_seg, g1, table.cu_segments, table.first, initial_state)
        o, _ = state_pass(q1, k1, v1, g1, beta1, A1, scale, S_in, table.cu_segments, True, False)
        return o.view(B, Tn, HV, V), (final if output_final_state else None)

    N, P = len(plan.lengths), plan.max_per_sequence
    slot = table.slot.long()
    batched = lambda x, j: x[j * N : (j + 1) * N].view(N * HV, K, x.shape[-1])  # noqa: E731
    v_ext = torch.cat([v1, v1.new_zeros(1, B * Tn, HV, K)], dim=-1)
    h_ext = torch.zeros(plan.num_segments, HV, K, V + K, device=v.device, dtype=torch.float32)
    h_ext[..., V:].diagonal(dim1=-2, dim2=-1).fill_(1.0)
    _, BM = state_pass(q1, k1, v_ext, g1, beta1, A1, scale, h_ext, table.cu_segments, False, True)
    BM_slot = BM.new_zeros(P * N, HV, K, V + K).index_copy_(0, slot, BM)
    B_slot, M_slot = BM_slot[..., :V], BM_slot[..., V:]
    S_slot = B_slot.new_empty(P * N, HV, K, V)
    S_slot[:N] = 0 if initial_state is None else initial_state
    for j in range(P - 1):
        torch.baddbmm(batched(B_slot, j), batched(M_slot, j), batched(S_slot, j), out=batched(S_slot, j + 1))
    o, ht = state_pass(q1, k1, v1, g1, beta1, A1, scale, S_slot[slot], table.cu_segments, True,
                       bool(output_final_state))
    final = ht[table.last.long()] if output_final_state else None
    return o.view(B, Tn, HV, V), final
