"""Sequence split of the state/output pass: the segments of long sequences run in parallel CTAs (intra-card context
parallelism, done exactly). Mirrors reference layer E (reference.seq_split):

    over a segment of chunks the pass is affine in its entering state:  S_out = M S_in + B
  1. transitions  the state pass alone (no output) over every segment, with the value extended to [V | 0] and the
                  entering state to [0 | I] (a K x (V + K) state; the pass forms both): its final state is [B | M].
                  Without the delta rule M = exp(sum of g over the segment) I, a scalar per segment and head (1
                  without a gate), so the pass runs on V from a zero state for B alone
  2. entering     S_in(0) = the sequence's initial state (or 0), S_in(j + 1) = M_j S_in(j) + B_j, fp32: one launch
                  of seq_combine.py (per sequence and value head, serial over its segments; under the plain update
                  m_j summed from the gate there, and the final states too)
  3. outputs      the state/output pass over the segments as one varlen batch from the entering states; with the
                  delta rule a sequence's final state is that of its last segment

The warm-up (GDN: the delta rule with a scalar gate; reference.seq_split.warmup_table): step 1's CTAs first find
(warmup.py), per segment and value head, the fewest chunks before the segment over which the decay sums to
WARMUP_BOUND (e^-17, under fp32's rounding), and store the segment's row of the warm-up table; where every segment
of a (sequence, head) has such a warm-up of at most a segment's chunks, its transitions' CTAs run no chunk and its
outputs' CTAs start that many chunks early from a zero state (or from the sequence's initial state where the
warm-up reaches it), storing o from the segment on. The other (sequence, head)s (g = 0 heads, decays too weak) take
steps 1-3 as above. Decided on the device from the gate, so the split stays exact to fp32 rounding and capturable,
without a launch of its own. The table also names the initial state a segment starts from and the sequence whose final
state a segment's is, so the outputs pass reads the call's initial states and writes its final states itself: the
warm-up split moves no state besides.

Segments begin at chunk boundaries of their sequence, so the chunk-local gc and A are those of the unsplit call, and
so are KDA's factors (gla_factors.py), which launch.forward computes over the segments' tiles: their decays D are
indexed by tile slot, and both passes take the segments as their sequences. An empty sequence keeps one empty
segment (its final state is its initial state). The segment table comes from the
plan's host lengths in one non-blocking copy from pinned memory (host_tables.py), so nothing synchronises with the
host: the split is four launches (copy, transitions, combine, outputs), and with the delta rule without the
warm-up the initial states of the sequences left in one segment copied into the entering states and a gather of
the final states where the call has several sequences. Both passes launch the segments longest
first (the table's order), so that a skewed batch's long chains start in the first wave.

The split is an input transform: the passes it drives are ordinary varlen state passes whose sequences are the
segments (they know nothing of segments), given as functions (split_forward): the TileLang passes of the plan on the
GPU (launch.py), any other implementation of the same contract elsewhere; the combine likewise (launch.launch_combine
on the GPU, reference.entering_states and reference.transition_entering_states elsewhere). The transitions' pass
leaves o unwritten. The split's cost model and the SegmentPlan live in plan.py.
"""

from typing import NamedTuple

import torch

from .host_tables import EAGER_TABLES, device_table, latest
from .plan import CHUNK, SegmentPlan, segment_count


class SegmentTable(NamedTuple):
    """A plan's segments as index tensors (int32): cu_segments [S + 1] the segments' token boundaries (the passes'
    varlen layout); first [N + 1]: sequence n's segments are first[n] to first[n + 1] - 1; last [N]: each
    sequence's last segment; order [S]: the segments longest first, stably (the passes' launch order); split [M]:
    the sequences cut into more than one segment (the delta rule's combine runs over them); singles [N - M]: the
    others, single_rows [N - M]: their segments."""

    cu_segments: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    order: torch.Tensor
    split: torch.Tensor
    singles: torch.Tensor
    single_rows: torch.Tensor


def host_table(plan: SegmentPlan) -> tuple[list[int], ...]:
    """The SegmentTable's tensors as host lists, from plan.lengths."""
    tokens = CHUNK * plan.segment_chunks
    starts, first, bos = [], [0], 0
    for length in plan.lengths:
        starts += [bos + j * tokens for j in range(segment_count(length, plan.segment_chunks))]
        first.append(len(starts))
        bos += length
    cu = starts + [bos]
    order = sorted(range(len(starts)), key=lambda s: cu[s] - cu[s + 1])
    split = [n for n in range(len(plan.lengths)) if first[n + 1] - first[n] > 1]
    singles = [n for n in range(len(plan.lengths)) if first[n + 1] - first[n] == 1]
    return cu, first, [n - 1 for n in first[1:]], order, split, singles, [first[n] for n in singles]


def _flat_table(plan: SegmentPlan) -> list[int]:
    return sum(host_table(plan), [])


# id(table) -> (the table, its views), the VIEWS_KEPT latest; keyed by identity, as a tensor's == is elementwise (an
# entry holds its table, so its id names no other tensor while it is kept)
_VIEWS: "dict[int, tuple[torch.Tensor, SegmentTable]]" = {}
VIEWS_KEPT = EAGER_TABLES


def segment_table(plan: SegmentPlan, device: torch.device) -> SegmentTable:
    """The plan's SegmentTable on the device, in one table of host_tables (one non-blocking copy on a GPU, none
    when the plan's table is there already), viewed once per table while it is among the VIEWS_KEPT latest."""
    packed = device_table(_flat_table, plan, device)
    S, N, M = plan.num_segments, len(plan.lengths), plan.num_split
    return latest(_VIEWS, id(packed), lambda: (packed, SegmentTable(*packed.split([S + 1, N + 1, N, S, M, N - M,
                                                                                  N - M]))), VIEWS_KEPT)[1]


def flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] as [1, B * T, ...]: the tile-parallel kernels' and the split's token layout (x itself where B = 1,
    so a varlen call pays no view per launch argument)."""
    return x if x.shape[0] == 1 else x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def split_forward(transitions, outputs, combine, q, k, v, g, beta, A, initial_state, output_final_state,
                  split: SegmentPlan, warmup: bool = False):
    """The state/output pass of the unsplit call ((o [B,T,HV,V], final state [N,HV,K,V] fp32 or None)), computed
    segment-parallel as an input transform: the segments become the sequences of one varlen batch (cu_segments) and
    their entering states its initial states. split must be SegmentPlan.of(the call's sequence lengths) (plan.py makes
    it so); g is the gate's chunk-local cumsum (or None), A kkt_solve's output (delta rule) or None.

    transitions / outputs: `pass(q, k, v, g, beta, A, h0, cu_seqlens, order) -> (o, final states)` in the varlen
    layout, order the segments' launch order (SegmentTable.order; no result depends on it);
    transitions keep the state alone and store every segment's final state (with the delta rule from [0 | I] with
    the value [v | 0], which the pass forms itself: h0 None, final states K x (V + K)), outputs store o (and, with
    the delta rule, the final states when asked for). combine: step 2 (launch.launch_combine on the GPU, the
    reference's elsewhere): under the plain update combine(B, g, cu_segments, first, h0) -> (S_in, final)
    (reference.entering_states), with the delta rule combine(BM, table, h0, warm) -> S_in, table the SegmentTable
    (reference.transition_entering_states on table.first). warmup: the delta rule's warm-up (GDN), where the
    transitions also form the warm-up table, `transitions(..., order, first, max_chunks, initial) -> (warm,
    [B | M])` (first the SegmentTable's, max_chunks the segment's chunks, initial whether there are initial states;
    reference.warmup_table's table, and [B | M] at the segments it leaves to the transitions), which the combine
    and the outputs then take. Under the warm-up the outputs pass also takes the initial states, `outputs(...,
    order, warm, h0) -> (o, final states [N, HV, K, V])`: the table names the initial state a segment starts from
    and the sequence whose final state a segment's is.

    Plain update: the transitions from a zero state give B, the combine S_in and the final states. Delta rule: the
    transitions on [V | 0] from [0 | I] give [B | M], the combine S_in per segment (serial over a sequence's
    segments, S_in[j + 1] = M[j] S_in[j] + B[j]; the first segment's alone for a (sequence, head) the warm-up
    takes), the outputs pass o and each segment's final state, of which a sequence's last is its own (under the
    warm-up the outputs pass reads the initial states and stores the sequences' final states itself)."""
    B, Tn, HV, V = v.shape
    q1, k1, v1, g1, beta1, A1 = (None if x is None else flat(x) for x in (q, k, v, g, beta, A))
    table = segment_table(split, v.device)
    if A is None:
        _, B_seg = transitions(q1, k1, v1, g1, beta1, A1, None, table.cu_segments, table.order)
        S_in, final = combine(B_seg, g1, table.cu_segments, table.first, initial_state)
        o, _ = outputs(q1, k1, v1, g1, beta1, A1, S_in, table.cu_segments, table.order)
        return o.view(B, Tn, HV, V), (final if output_final_state else None)

    if warmup:
        warm, BM = transitions(q1, k1, v1, g1, beta1, A1, None, table.cu_segments, table.order, table.first,
                               split.segment_chunks, initial_state is not None)
        S_in = combine(BM, table, initial_state, warm)
        o, final = outputs(q1, k1, v1, g1, beta1, A1, S_in, table.cu_segments, table.order, warm, initial_state)
        return o.view(B, Tn, HV, V), (final if output_final_state else None)
    _, BM = transitions(q1, k1, v1, g1, beta1, A1, None, table.cu_segments, table.order)
    S_in = combine(BM, table, initial_state, None)
    o, ht = outputs(q1, k1, v1, g1, beta1, A1, S_in, table.cu_segments, table.order)
    # one sequence (a long-context call): its last segment's state is the last row, no gather
    final = None if not output_final_state else ht[-1:] if len(split.lengths) == 1 else ht.index_select(0, table.last)
    return o.view(B, Tn, HV, V), final
