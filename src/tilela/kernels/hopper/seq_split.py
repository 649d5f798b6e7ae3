"""Sequence split of the state/output pass: the segments of long sequences run in parallel CTAs (intra-card context
parallelism, done exactly). Mirrors reference layer E (reference.seq_split):

    over a segment of chunks the pass is affine in its entering state:  S_out = M S_in + B
  1. transitions  the state pass alone (no output) over every segment, with the value extended to [V | 0] and the
                  entering state to [0 | I] (a K x (V + K) state; the pass forms both): its final state is [B | M].
                  Without the delta rule M = exp(sum of g over the segment) I, a scalar per segment and head (1
                  without a gate), so the pass runs on V from a zero state for B alone
  2. entering     S_in(0) = the sequence's initial state (or 0), S_in(j + 1) = M_j S_in(j) + B_j, fp32: under the
                  plain update one launch of seq_combine.py (per sequence and value head, serial over its
                  segments, m_j summed from the gate there; it also gives the final states); with the delta rule
                  one batched product per segment index over the sequences cut into segments and the heads
                  (torch.baddbmm)
  3. outputs      the state/output pass over the segments as one varlen batch from the entering states; with the
                  delta rule a sequence's final state is that of its last segment

The warm-up (GDN: the delta rule with a scalar gate; reference.seq_split.warmup_table): before step 1 one launch
of warmup.py finds, per segment and value head, the fewest chunks before the segment over which the decay sums to
WARMUP_BOUND (e^-17, under fp32's rounding); where every segment of a (sequence, head) has such a warm-up of at
most a segment's chunks, its transitions' CTAs run no chunk and its outputs' CTAs start that many chunks early from
a zero state (or from the sequence's initial state where the warm-up reaches it), storing o from the segment on.
The other (sequence, head)s (g = 0 heads, decays too weak) take steps 1-3 as above. Decided on the device from the
gate, so the split stays exact to fp32 rounding and capturable, with one launch more.

Segments begin at chunk boundaries of their sequence, so the chunk-local gc and A are those of the unsplit call. An
empty sequence keeps one empty segment (its final state is its initial state). The segment table comes from the
plan's host lengths in one non-blocking copy from pinned memory, so nothing synchronises with the host: under the
plain update the split is four launches (copy, transitions, combine, outputs). A CUDA graph captured after an eager
call of the same plan reads that call's copy and has three nodes; captured first, the copy is its fourth node.

The split is an input transform: the passes it drives are ordinary varlen state passes whose sequences are the
segments (they know nothing of segments), given as functions (split_forward): the TileLang passes of the plan on the
GPU (launch.py), any other implementation of the same contract elsewhere; the plain update's combine likewise
(launch.seq_combine on the GPU, reference.entering_states elsewhere). The transitions' pass leaves o unwritten. The
delta rule's combine runs torch.baddbmm in fp32, so it honours a caller's TF32 setting (PyTorch's default keeps it
off). The split's cost model and the SegmentPlan live in plan.py.
"""

import functools
from typing import NamedTuple

import torch

from .plan import CHUNK, SegmentPlan, segment_count


class SegmentTable(NamedTuple):
    """A plan's segments as index tensors (int32): cu_segments [S + 1] the segments' token boundaries (the passes'
    varlen layout); first [N + 1]: sequence n's segments are first[n] to first[n + 1] - 1; last [N]: each
    sequence's last segment. The delta rule's combine runs over the M sequences cut into more than one segment
    (split [M], in order), on a [P, M] grid (P = plan.max_per_sequence): combined [C] those sequences' segments
    and grid [C] their slots, j * M + m for the j-th segment of the m-th of them; slot [S]: the row of segment s's
    entering state in the combine's rows, [P * M] of the grid, then [N] of the sequences' initial states (a
    sequence in one segment enters from its own)."""

    cu_segments: torch.Tensor
    first: torch.Tensor
    slot: torch.Tensor
    last: torch.Tensor
    split: torch.Tensor
    combined: torch.Tensor
    grid: torch.Tensor


def host_table(plan: SegmentPlan) -> tuple[list[int], ...]:
    """The SegmentTable's tensors as host lists, from plan.lengths."""
    tokens, N, P = CHUNK * plan.segment_chunks, len(plan.lengths), plan.max_per_sequence
    counts = [segment_count(length, plan.segment_chunks) for length in plan.lengths]
    split = [n for n, count in enumerate(counts) if count > 1]
    M, rank = len(split), {n: m for m, n in enumerate(split)}
    starts, first, slots, last, combined, grid, bos = [], [0], [], [], [], [], 0
    for n, (length, count) in enumerate(zip(plan.lengths, counts)):
        starts += [bos + j * tokens for j in range(count)]
        if n in rank:
            combined += range(len(slots), len(slots) + count)
            grid += [j * M + rank[n] for j in range(count)]
            slots += grid[-count:]
        else:
            slots.append(P * M + n)
        first.append(len(slots))
        last.append(len(slots) - 1)
        bos += length
    return starts + [bos], first, slots, last, split, combined, grid


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
    S, N, M = plan.num_segments, len(plan.lengths), plan.num_split
    C = S - (N - M)
    return SegmentTable(*table.split([S + 1, N + 1, S, N, M, C, C]))


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


def split_forward(transitions, outputs, combine, q, k, v, g, beta, A, initial_state, output_final_state,
                  split: SegmentPlan, warmup=None):
    """The state/output pass of the unsplit call ((o [B,T,HV,V], final state [N,HV,K,V] fp32 or None)), computed
    segment-parallel as an input transform: the segments become the sequences of one varlen batch (cu_segments) and
    their entering states its initial states. split must be SegmentPlan.of(the call's sequence lengths) (plan.py makes
    it so); g is the gate's chunk-local cumsum (or None), A kkt_solve's output (delta rule) or None.

    transitions / outputs: `pass(q, k, v, g, beta, A, h0, cu_seqlens) -> (o, final states)` in the varlen layout;
    transitions keep the state alone and store every segment's final state (with the delta rule from [0 | I] with
    the value [v | 0], which the pass forms itself: h0 None, final states K x (V + K)), outputs store o (and, with
    the delta rule, the final states when asked for). combine(B, g, cu_segments, first, h0) -> (S_in, final): the plain
    update's step 2 (launch.seq_combine on the GPU, reference.entering_states elsewhere); None with the delta rule.
    warmup(g, cu_segments, first, max_chunks) -> table: the delta rule's warm-up table (launch.launch_warmup on the
    GPU, reference.warmup_table elsewhere; max_chunks the segment's chunks), which the delta rule's transitions and
    outputs then take as a ninth argument, warm; None: no warm-up.

    Plain update: the transitions from a zero state give B, the combine S_in and the final states. Delta rule: the
    transitions on [V | 0] from [0 | I] give [B | M], and the combine walks the [P, M] grid of the M sequences
    cut into more than one segment (SegmentTable): step j is one batched fp32 product over them and the HV heads,
    S_in[j + 1] = M[j] S_in[j] + B[j]; a sequence with fewer than P segments has M = B = 0 in its empty slots,
    whose entering states are never read; a sequence in one segment enters from its initial state."""
    B, Tn, HV, V = v.shape
    K = q.shape[-1]
    q1, k1, v1, g1, beta1, A1 = (None if x is None else x.reshape(1, B * Tn, *x.shape[2:])
                                 for x in (q, k, v, g, beta, A))
    table = segment_table(split, v.device)
    if A is None:
        _, B_seg = transitions(q1, k1, v1, g1, beta1, A1, None, table.cu_segments)
        S_in, final = combine(B_seg, g1, table.cu_segments, table.first, initial_state)
        o, _ = outputs(q1, k1, v1, g1, beta1, A1, S_in, table.cu_segments)
        return o.view(B, Tn, HV, V), (final if output_final_state else None)

    warm = None if warmup is None else warmup(g1, table.cu_segments, table.first, split.segment_chunks)
    extra = () if warm is None else (warm,)
    N, P, M = len(split.lengths), split.max_per_sequence, split.num_split
    # one sequence cut into segments (a long-context call): its grid is its segments in order, and the entering
    # states are the grid's rows, so no gathers or copies
    alone = N == 1 and M == 1
    batched = lambda x, j: x[j * M : (j + 1) * M].view(M * HV, K, x.shape[-1])  # noqa: E731
    _, BM = transitions(q1, k1, v1, g1, beta1, A1, None, table.cu_segments, *extra)
    BM_grid = BM if alone else BM.new_zeros(P * M, HV, K, V + K).index_copy_(0, table.grid.long(),
                                                                              BM[table.combined.long()])
    B_grid, M_grid = BM_grid[..., :V], BM_grid[..., V:]
    S_rows = B_grid.new_empty(P * M + (0 if alone else N), HV, K, V)  # the grid's entering states, the initial ones
    if alone:
        S_rows[:1] = 0 if initial_state is None else initial_state
    else:
        S_rows[:M] = 0 if initial_state is None else initial_state[table.split.long()]
        S_rows[P * M :] = 0 if initial_state is None else initial_state
    for j in range(P - 1):
        torch.baddbmm(batched(B_grid, j), batched(M_grid, j), batched(S_rows, j), out=batched(S_rows, j + 1))
    entering = S_rows if alone else S_rows[table.slot.long()]
    o, ht = outputs(q1, k1, v1, g1, beta1, A1, entering, table.cu_segments, *extra)
    final = None if not output_final_state else ht[-1:] if alone else ht[table.last.long()]
    return o.view(B, Tn, HV, V), final
