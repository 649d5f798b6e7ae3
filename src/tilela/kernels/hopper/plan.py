"""Every decision of a Hopper call, made once: `make_plan` returns a frozen `Plan` that `launch.forward` executes.

Pure Python (no TileLang import): the plan is computed from host facts only (dtypes, head sizes, the host sequence
lengths, the SM count), so nothing synchronises with the device and a test can inspect it on any machine.

A plan answers, in this order:
  coverage     does the TileLang pipeline serve this call at all (`covers`), else the PyTorch path runs
  gate         "none", "scalar" ([B, T, HV]) or "channel" ([B, T, HV, K], per key channel)
  update rule  the delta rule (beta, kkt_solve's A; Ab = A diag(beta) for the warp-specialised pass) or the plain
               update S += K^T V
  stages       cumsum of the gate (unless a later stage sums it in its tiles), kkt_solve (delta rule; it sums a
               scalar gate itself), gla_factors (per-channel gate on the warp-specialised pass, summing the gate;
               with the delta rule it forms A too, in place of kkt_solve), then one state/output pass
  state pass   "ws" (chunk_fwd_ws.py, K = V in {64, 128}) or "loop" (chunk_fwd.py, every configuration); "auto"
               takes ws wherever it covers; its DV block from the cost model below
  split        the sequence split (seq_split.py) where the cost model says it pays: the transitions' pass, the
               combine, then the output pass over the segments as one varlen batch; GDN's (the delta rule with a
               scalar gate) with the warm-up table (warmup.py), which both passes read; KDA's (the per-channel delta
               rule) after gla_factors over the segments' tiles, without the warm-up (its calmest channel, not
               the head, bounds the past)
Each stage's static configuration is its compile key; the launchers pass it to the builder unchanged.

Cost model. A state pass is bound by each CTA's serial chain of chunks with one CTA per SM, so a launch takes about
waves x chunks x the chunk period of its (update rule, K / DV block, output group on); over chains of unequal length
(a skewed varlen batch, the split's segments), which launch longest first (launch_order, the segment table's
order), the longest chains' waves or the whole work spread over the SMs, whichever is more (chains_us). The
periods (CHUNK_US, in us at K = 128 on the H200; K = 64 takes those of the same K / DV block) and the split's fixed
and per-step costs are data fitted to H200 measurements; each table names the section of benchmarks/NOTES.md it
comes from. The split's combine products and state copies are counted from their FLOPs and bytes.

Glossary: "plain" the plain update without a scalar gate (the state adds K^T V straight from the input slots), "vd"
the plain update through a written Vd = exp(gc_last - gc) ⊙ V (scalar gate), "gdn" the gated delta rule, "kda" the
per-key-channel gated delta rule, "delta" the ungated delta rule; "transitions" the split's state-only pass from a
zero state, "combine" its entering states.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..._gates import GATE_FORMS

CHUNK = 64  # tokens per chunk of every stage (and per tile of the tile-parallel kernels)
# KDA's short-chunk path (make_plan's chunk option): the cumsum, kkt_solve's Neumann inverse and the loop pass at 16.
# make_plan takes it only when asked: on every KDA layout of the bench it measured 6-38x the chunk-64 pipeline's time
# (1.1-1.8x the loop pass at 64; "the short-chunk path measured" in benchmarks/NOTES.md)
SHORT_CHUNK = 16
GATES = ("none", "scalar", "channel")
HALF = ("bfloat16", "float16")
L2NORM_DIMS = (64, 128, 256)

# ---- cost model (data) -------------------------------------------------------------------------------------------
# (update rule, K / DV block, output group on) -> chunk period in us; where each comes from (benchmarks/NOTES.md and
# the result files it names):
#   gdn, with output     "DV blocks of K / 4: the pass 24-32% faster below one wave"; K / 4 at its full-GPU period;
#                        K / 1 kept at its state/value-group period: the chain groups' 3.7 us ("two chain groups at
#                        DV block K") moved the skewed batch at h4/16 to a split that measured slower
#   gdn, without output  "The sequence split: measured, modelled, switched on" (the transitions, value [V | 0]);
#                        K / 2 refitted in "GDN's warm-up split judged on both gate regimes" (its periods at
#                        64-128 CTAs and 64-128 chunks); K / 4 without output never measured, so never picked
#   delta                gdn's, and K / 8 from "the plain update's lean split, two output groups, K / 8 for delta_rule"
#   plain / vd           "Chunk periods of the plain update" and, under "the plain update straight from V, deeper
#                        input slots", its "Sweeps"
#   kda                  "KDA on the warp-specialised pass: measured" (the pass's profiled time per chunk); K / 8
#                        from "The KDA pass's DV blocks on small grids" (one wave, 128-1024 chunks; `tilela bench
#                        --op kda --impls tilela_dv16,tilela_dv32,tilela_dv64 --profile` measures them); without
#                        output (the split's transitions on [V | 0]) from "KDA's sequence split" (one wave of 128
#                        CTAs, 128-512 chunks)
_GDN_US = {(4, True): 1.86, (2, True): 2.3, (1, True): 4.1, (2, False): 3.0, (1, False): 4.2}
CHUNK_US = {
    **{("gdn", *key): us for key, us in _GDN_US.items()},
    **{("delta", *key): us for key, us in _GDN_US.items()},
    ("delta", 8, True): 1.25,
    ("plain", 4, True): 0.85, ("plain", 2, True): 1.6, ("plain", 1, True): 3.2,
    ("plain", 2, False): 0.55, ("plain", 1, False): 1.1,
    ("vd", 4, True): 1.15, ("vd", 2, True): 2.0, ("vd", 1, True): 3.5,
    ("vd", 2, False): 1.0, ("vd", 1, False): 1.73,
    ("kda", 2, True): 2.2, ("kda", 4, True): 1.43, ("kda", 8, True): 1.01,  # no K / 1 (dv_blocks)
    ("kda", 2, False): 1.73, ("kda", 4, False): 1.06, ("kda", 8, False): 0.86,
}
# The split's own cost by update rule (delta rule or not): a fixed cost (the table's copy, the combine launch, the gaps
# between launches) and a cost per combine step (one batched product per segment index with the delta rule, a
# pipelined multiply-add without); fitted in "The sequence split: measured, modelled, switched on" (delta rule) and
# "the plain update's lean split, two output groups" (plain update); the delta rule's step refitted to the matrix
# combine one step ahead ("COMBINE_STEP_MS refit" there: 4.2 us a step).
SPLIT_FIXED_MS = {True: 0.07, False: 0.015}
COMBINE_STEP_MS = {True: 0.0042, False: 0.0005}
# The delta rule's combine (seq_combine.py, "matrix"): each step a K x K by K x V product per (sequence cut into
# segments, value head) in fp32 on the CUDA cores; at many split sequences the products, not a step's latency,
# decide. The FMA rate below is an estimate (half the H200's fp32 peak), not a fit.
COMBINE_FP32_FLOPS = 30e12
# The delta rule's split moves whole states besides: the initial states of the sequences left in one segment into
# the entering states, and every sequence's final state out of its last segment's (a gather); both at this rate
# (bytes read and written per second), fitted to the skewed batch's 33 us gather of 134 MB ("longest chains first,
# kkt_solve sums GDN's gate, the combine over split sequences").
STATE_COPY_BYTES_PER_S = 4.0e12
# gla_factors (KDA's state-independent factors) runs one CTA per (tile, value head), FACTORS_PER_SM of them an SM by
# its q/k dtype (its score operands: bf16 for bf16 inputs; fp32 for fp16 ones, which leave room for two), in waves of
# FACTORS_WAVE_US by the gate form it forms (K = 128; K = 64 takes half); a wave started is a wave paid. Fitted with
# the token-range pipeline's cuts in "The token-range pipeline refitted" (benchmarks/NOTES.md: 1x8192 and 1x32768 h8,
# both gate forms; the log form fed the same gate values measured 3% over the sigmoid one).
FACTORS_PER_SM = {"bfloat16": 3, "float16": 2}
FACTORS_WAVE_US = {"softplus": 29.0, "sigmoid": 18.0, "log": 18.5}
# The token-range pipeline (pipeline_us): the first range's share candidates of the sequence's chunks and the counts
# of equal ranges after it (more ranges measured slower: each range's factors start a wave of their own); the later
# ranges' factors run on the SMs the pass leaves at FACTORS_BESIDE_PASS of their speed alone (they share the memory
# system with the pass), and each range past the first costs PIPELINE_RANGE_US more (its launches and the handover
# of the SMs).
PIPELINE_FIRST = (1 / 4, 1 / 3, 1 / 2, 2 / 3, 3 / 4)
PIPELINE_RANGES = (1, 2)
FACTORS_BESIDE_PASS = 0.8
PIPELINE_RANGE_US = 10.0
# kkt_solve runs a q/k head's groups of value heads side by side, a CTA each, while its (tile, q/k head) CTAs number
# fewer than this many per SM ("kkt_solve's value-head groups side by side" in benchmarks/NOTES.md: 1x512 h2/8 13.8
# -> 8.4 us; at 512 such CTAs (1x2048 h16/64) and above the groups in turn, K K^T formed once, measured faster)
KKT_SIDE_BY_SIDE_PER_SM = 2
SEGMENT_CHUNKS = (8, 16, 32, 64, 128, 256)
# Segments per sequence of the wave-sized candidates: the longest sequence cut into this many equal segments.
SEGMENT_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32)
# The warm-up split (GDN): chunks a decaying head's warm-up is modelled to take before its segment. A head whose
# per-chunk decay is d needs ceil(17 / |d|) chunks; FLA's layer initialisation gives most heads |d| > 8.
WARMUP_CHUNKS = 2
# The share of value heads through the transitions (g = 0, or decays too weak for a warm-up) in the second gate
# regime the warm-up split is judged on: FlashQLA's benchmark gate leaves a quarter of the heads without decay.
MIXED_UNBOUNDED = 0.25
# The warm-up split is judged on the geometric mean of the two regimes' modelled times (every head decaying;
# MIXED_UNBOUNDED through the transitions), the segment size of least mean taken where it is at most this share of
# the unsplit pass's ("GDN's warm-up split judged on both gate regimes" in benchmarks/NOTES.md: over 11 long layouts
# its picks are within 0-4.4% of the measured best mean; the split-only margin below would leave three of them
# unsplit at 1.17-1.24x the best).
MIXED_MARGIN = 0.85
# The split must beat the unsplit pass's modelled time by this factor: it covers the transitions' longer chunk period
# when they fill the GPU several waves deep (shared bandwidth), which the model leaves out.
SPLIT_MARGIN = 0.8


def update_rule(gate: str, delta: bool) -> str:
    """The chunk-period key of a configuration (glossary above)."""
    if delta:
        return {"none": "delta", "scalar": "gdn", "channel": "kda"}[gate]
    return "vd" if gate == "scalar" else "plain"


def dv_blocks(K: int, gate: str = "none", delta: bool = False) -> tuple[int, ...]:
    """The DV blocks the warp-specialised pass is built for, largest first: K, K / 2, K / 4 and K / 8, down to 16;
    not K under the per-channel delta rule (its Kg and P input slots leave no room for two slots at K)."""
    top = K // 2 if gate == "channel" and delta else K
    return tuple(block for block in (K, K // 2, K // 4, K // 8) if 16 <= block <= top)


def default_block_DV(K: int, V: int, grid: int, sms: int = 132, store_output: bool = True, rule: str = "gdn",
                     chains: "Chains | None" = None) -> int:
    """The DV block (of dv_blocks(K) with a chunk period; 16 columns only at K = 128) of least modelled time for
    grid = sequences x value heads on sms SMs; the larger block on a tie (q/k loads and Q K^T once per block).
    chains: the sequences' chunk chains (Chains; grid = chains.count x heads), so that a skewed batch's longest
    chain counts at its own period; None: grid chains of one chunk each. V > K only in the split's delta-rule
    transitions (V = 2K: the [V | 0] value)."""
    blocks = [block for block in dv_blocks(K) if (block >= 32 or K >= 128) and (rule, K // block, store_output)
              in CHUNK_US]
    if chains is None or chains.count == 0:
        chains = Chains(grid, 1, grid, grid, 1)
    heads = grid // chains.count
    return min(blocks, key=lambda block: chains_us(K, V, heads, chains, block, sms, store_output, rule))


def chains_us(K: int, V: int, heads: int, chains: "Chains", block_DV: int, sms: int, store_output: bool,
              rule: str) -> float:
    """Modelled time of a launch over chains x heads x DV blocks CTAs, one CTA per SM at a time, the chains launched
    longest first: the longest chain where every CTA fits on the SMs at once; else that list schedule's makespan,
    the longest chains' waves or the whole work spread over the SMs plus a shortest chain (the tail: the last
    chains to start are the shortest), whichever is more; at most every chain in waves of the longest."""
    ctas = heads * (V // block_DV)
    if chains.count * ctas <= sms:
        chunks = chains.longest
    else:
        waves = math.ceil(chains.longest_count * ctas / sms) * chains.longest
        spread = chains.total * ctas / sms + chains.shortest
        chunks = min(math.ceil(chains.count * ctas / sms) * chains.longest, max(waves, spread))
    return CHUNK_US[(rule, K // block_DV, store_output)] * chunks


# ---- sequence split --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SegmentPlan:
    """A split of sequences of the given host lengths: segment_chunks chunks per segment (a sequence's last segment
    may be shorter), num_segments over all sequences, max_per_sequence of any one sequence, num_split sequences cut
    into more than one (those the delta rule's combine runs over)."""

    segment_chunks: int
    num_segments: int
    max_per_sequence: int
    num_split: int
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, lengths, segment_chunks: int) -> "SegmentPlan":
        if segment_chunks < 1:
            raise ValueError(f"segment_chunks: expected >= 1, got {segment_chunks}")
        lengths = tuple(int(n) for n in lengths)
        counts = [segment_count(n, segment_chunks) for n in lengths]
        return cls(segment_chunks, sum(counts), max(counts, default=1), sum(c > 1 for c in counts), lengths)


def segment_count(length: int, segment_chunks: int) -> int:
    """Segments of one sequence of `length` tokens (an empty sequence keeps one)."""
    return max(1, math.ceil(length / (CHUNK * segment_chunks)))


def _pass_ms(K: int, V: int, heads: int, chains: "Chains", sms: int, store_output: bool, rule: str) -> float:
    """chains_us at the DV block default_block_DV picks for the chains, in ms."""
    block = default_block_DV(K, V, chains.count * heads, sms, store_output, rule, chains)
    return 1e-3 * chains_us(K, V, heads, chains, block, sms, store_output, rule)


@dataclass(frozen=True)
class Chains:
    """The chunk chains of a launch's sequences (or segments): how many, the longest, how many of it, the sum, the
    shortest."""

    count: int
    longest: int
    longest_count: int
    total: int
    shortest: int

    @classmethod
    def of(cls, lengths, segment_chunks: int | None = None, warmup: int = 0) -> "Chains":
        """Each sequence's chunks, or its segments' of segment_chunks chunks with `warmup` chunks before each but a
        sequence's first."""
        chains = []
        for n in lengths:
            chunks = math.ceil(n / CHUNK)
            if segment_chunks is None or chunks <= segment_chunks:
                chains.append(chunks)
                continue
            full, rest = divmod(chunks, segment_chunks)
            chains += [segment_chunks] + [segment_chunks + warmup] * (full - 1) + ([rest + warmup] if rest else [])
        longest = max(chains, default=0)
        return cls(len(chains), longest, chains.count(longest), sum(chains), min(chains, default=0))


def warms(gate: str, delta: bool) -> bool:
    """Whether the sequence split takes the warm-up (warmup.py): the delta rule with a scalar gate, where the
    transitions cost a pass on [V | 0] and a decaying head can skip them."""
    return gate == "scalar" and delta


def modelled_ms(lengths, heads: int, sms: int, split: SegmentPlan | None, K: int = 128, gate: str = "scalar",
                delta: bool = True, unbounded: float = 1.0) -> float:
    """Modelled time of the state/output pass unsplit (split None) or split: transitions (the state alone, value
    [V | 0] with the delta rule, V without), combine steps, outputs and the split's fixed cost; each pass at the DV
    block default_block_DV picks for it. unbounded (the warm-up split, warms): the share of value heads whose decay
    does not bound a warm-up, so that they take the transitions (1: every head, as g = 0 everywhere); the others'
    CTAs skip them and start their outputs WARMUP_CHUNKS early."""
    rule = update_rule(gate, delta)
    if split is None:
        return _pass_ms(K, K, heads, Chains.of(lengths), sms, True, rule)
    warmup = warms(gate, delta)
    segments = Chains.of(lengths, split.segment_chunks)
    through = math.ceil(heads * unbounded) if warmup else heads  # value heads through the transitions
    transitions = _pass_ms(K, 2 * K if delta else K, through, segments, sms, False, rule) if through else 0.0
    warmed = warmup and unbounded < 1  # some heads start their outputs early
    outputs = _pass_ms(K, K, heads, Chains.of(lengths, split.segment_chunks, WARMUP_CHUNKS) if warmed else segments,
                       sms, True, rule)
    return transitions + outputs + SPLIT_FIXED_MS[delta] + _combine_ms(split, heads, K, delta, warmup)


def _combine_ms(split: SegmentPlan, heads: int, K: int, delta: bool, warmup: bool) -> float:
    """The combine's steps (one per segment past a sequence's first, serial within a sequence), with the delta rule
    each at least its products' time over the sequences cut into more than one segment and the value heads
    (V = K), and without the warm-up its state copies: the single-segment sequences' initial states in, every
    sequence's final state out where there are several (under the warm-up the outputs pass reads and writes
    them in place)."""
    steps = split.max_per_sequence - 1
    if not delta:
        return steps * COMBINE_STEP_MS[False]
    pairs = split.num_split * heads
    N = len(split.lengths)
    copied = 0 if warmup else (N - split.num_split) + (N if N > 1 else 0)  # states of heads x K x K fp32, in and out
    return (steps * max(COMBINE_STEP_MS[True], 1e3 * pairs * 2 * K**3 / COMBINE_FP32_FLOPS)
            + 1e3 * copied * heads * K * K * 4 * 2 / STATE_COPY_BYTES_PER_S)


def segment_sizes(longest: int) -> list[int]:
    """The candidate segment sizes in chunks for a longest sequence of `longest` chunks, shortest first: the powers
    SEGMENT_CHUNKS and the longest sequence cut into SEGMENT_COUNTS equal parts (sized by waves of CTAs rather than
    powers of two); each shorter than the sequence."""
    sizes = set(SEGMENT_CHUNKS) | {math.ceil(longest / count) for count in SEGMENT_COUNTS}
    return sorted(size for size in sizes if 4 <= size < longest)


def auto_split(lengths, heads: int, sms: int, K: int = 128, gate: str = "scalar",
               delta: bool = True) -> SegmentPlan | None:
    """The segment size (segment_sizes) of least modelled time, if it is at most SPLIT_MARGIN of the unsplit pass's;
    else None. Under the warm-up (warms) the time is the geometric mean of the two gate regimes' (every head
    decaying; MIXED_UNBOUNDED of the heads through the transitions), held to MIXED_MARGIN instead."""
    longest = max((math.ceil(n / CHUNK) for n in lengths), default=0)
    warmup = warms(gate, delta)

    def split_ms(split):  # unsplit (None): the gate regime does not enter the model
        if not warmup:
            return modelled_ms(lengths, heads, sms, split, K, gate, delta)
        return math.sqrt(modelled_ms(lengths, heads, sms, split, K, gate, delta, unbounded=0.0)
                         * modelled_ms(lengths, heads, sms, split, K, gate, delta, MIXED_UNBOUNDED))

    best, best_ms = None, (MIXED_MARGIN if warmup else SPLIT_MARGIN) * split_ms(None)
    for segment_chunks in segment_sizes(longest):
        split = SegmentPlan.of(lengths, segment_chunks)
        ms = split_ms(split)
        if ms < best_ms:
            best, best_ms = split, ms
    return best


def launch_order(lengths, ctas: int, sms: int) -> tuple[int, ...] | None:
    """The unsplit pass's launch order of a varlen batch (the grid walks it, common.sequence_of): its sequences
    longest first, stably; None where the batch order serves, as every CTA (ctas per sequence) starts in the first
    wave or no sequence is longer than one before it."""
    if len(lengths) * ctas <= sms or all(a >= b for a, b in zip(lengths, lengths[1:])):
        return None
    return tuple(sorted(range(len(lengths)), key=lambda n: -lengths[n]))


# ---- token-range pipeline ----------------------------------------------------------------------------------------
def factors_us(tiles: int, sms: float, wave_us: float, per_sm: int) -> float:
    """gla_factors over `tiles` (tile, value head) CTAs on `sms` SMs: its waves, each started one paid whole."""
    return wave_us * math.ceil(tiles / (per_sm * sms))


def pipeline_us(ranges, heads: int, sms: int, free_sms: int, wave_us: float, per_sm: int, period_us: float) -> float:
    """Modelled time of the token-range pipeline over ranges (chunks per range, in order): the first range's factors
    on all sms, then each range's pass (period_us a chunk) once the pass before it and the range's factors are done
    (PIPELINE_RANGE_US more for each range past the first), the later ranges' factors running meanwhile on the
    free_sms the pass leaves, at FACTORS_BESIDE_PASS of their speed."""
    ready = pass_end = factors_us(ranges[0] * heads, sms, wave_us, per_sm)
    for index, chunks in enumerate(ranges):
        if index:
            ready += factors_us(chunks * heads, free_sms * FACTORS_BESIDE_PASS, wave_us, per_sm)
        pass_end = max(pass_end, ready) + chunks * period_us + (PIPELINE_RANGE_US if index else 0.0)
    return pass_end


def pipeline_bounds(chunks: int, first: int, count: int, length: int) -> tuple[int, ...]:
    """Token boundaries (0, ..., length) of a first range of `first` chunks and `count` near-equal ranges of whole
    chunks after it."""
    rest = chunks - first
    return (0, *(CHUNK * (first + rest * j // count) for j in range(count)), length)


def auto_pipeline(lengths, heads: int, sms: int, K: int, dtype: str, gate_form: str,
                  block_DV: int) -> tuple[int, ...] | None:
    """Token boundaries of KDA's token-range pipeline of least modelled time (pipeline_us over the candidates
    PIPELINE_FIRST x PIPELINE_RANGES) where its pass at block_DV (the unpipelined call's: larger blocks, fewer CTAs,
    measured slower in every cut) leaves SMs to the factors, if it beats the unpipelined call's model (gla_factors
    on the whole GPU, then the pass); else None. One sequence only (the ranges are its pieces)."""
    ctas = heads * (K // block_DV)
    if len(lengths) != 1 or ctas >= sms or ("kda", K // block_DV, True) not in CHUNK_US:
        return None
    chunks = math.ceil(lengths[0] / CHUNK)
    wave_us, per_sm = FACTORS_WAVE_US[gate_form] * K / 128, FACTORS_PER_SM[dtype]
    period_us = CHUNK_US[("kda", K // block_DV, True)]
    best = None
    best_us = factors_us(chunks * heads, sms, wave_us, per_sm) + chains_us(K, K, heads, Chains.of(lengths), block_DV,
                                                                          sms, True, "kda")
    for share in PIPELINE_FIRST:
        first = max(1, round(chunks * share))
        for count in PIPELINE_RANGES:
            if chunks - first < count:
                continue
            bounds = pipeline_bounds(chunks, first, count, lengths[0])
            ranges = [-(-(b - a) // CHUNK) for a, b in zip(bounds, bounds[1:])]
            us = pipeline_us(ranges, heads, sms, sms - ctas, wave_us, per_sm, period_us)
            if us < best_us:
                best, best_us = bounds, us
    return best


# ---- coverage ----------------------------------------------------------------------------------------------------
def covers(dtype: str, K: int, V: int, gate: str, delta: bool) -> bool:
    """Whether the TileLang pipeline serves a call: bf16/fp16, K = V in {64, 128, 256}; the per-channel gate only up
    to K = 128 (gla_factors: one thread per key channel; the loop pass's fp32 gate tile in shared memory). Every
    gate, any decay: the warp-specialised pipeline's per-channel scores are exact for any gate (gla_factors forms
    the scores of a key channel that decays by more than e^-160 over a chunk term by term)."""
    return dtype in HALF and K == V and K in (64, 128, 256) and (gate != "channel" or K <= 128)


def l2norm_covers(dtype: str, K: int) -> bool:
    """Whether l2norm.py serves q or k's use_qk_l2norm_in_kernel (without autograd): bf16/fp16, K in L2NORM_DIMS."""
    return dtype in HALF and K in L2NORM_DIMS


def ws_covers(dtype: str, K: int, V: int, gate: str, delta: bool) -> bool:
    """Whether the warp-specialised pass serves a configuration (else chunk_fwd.py's loop pass does)."""
    return dtype in HALF and K == V and K in (64, 128) and gate in GATES


def splits(gate: str, delta: bool) -> bool:
    """Whether the sequence split takes a configuration: its transitions are exp(segment decay) I (plain update) or
    read from [B | M] (delta rule, any gate: KDA's per-channel decay is inside M); the plain update's under a
    per-channel gate would be diagonal per key channel, which the combine lacks."""
    return gate != "channel" or delta


def loop_tiles(K: int, gate: str, delta: bool, dtype: str, chunk: int = CHUNK) -> tuple[int, int, int, int]:
    """chunk_fwd.py's tiles (block_DV, threads, num_stages, chunk): 32-wide DV blocks (4 CTAs per value head at V =
    128); one stage where double buffers would pass the 227 KiB of shared memory: q/k at K = 256; with the
    per-channel gate at K = 128, its fp32 gc tile plus the delta-rule tiles or the fp32 score operands of fp16
    inputs. Chunk 16: two warps (a 16 x 16 product's rows and columns cover no more), whose 16-row tiles leave room
    for two stages at every K."""
    if chunk == SHORT_CHUNK:
        return 32, 64, 2, chunk
    single = K >= 256 or (gate == "channel" and K >= 128 and (delta or dtype == "float16"))
    return 32, 128, 1 if single else 2, chunk


# ---- the plan ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PassConfig:
    """One state/output launch's static configuration, its compile key: `args` are the builder's arguments
    (chunk_fwd_ws.chunk_fwd_ws_kernel for kernel "ws", chunk_fwd.chunk_fwd_kernel for "loop"). tiles: (block_DV,
    store_output, warmup) for "ws" (warmup: the split's passes read the warm-up table), and a fourth, True, where
    the output is folded into the chain groups (make_plan's fold); (block_DV, threads, num_stages, chunk) for
    "loop"."""

    kernel: str
    K: int
    V: int
    scale: float
    gate: str
    delta: bool
    dtype: str
    beta_dtype: str
    is_varlen: bool
    use_initial_state: bool
    store_final_state: bool
    tiles: tuple

    @property
    def args(self) -> tuple:
        return (self.K, self.V, self.scale, self.gate, self.delta, self.dtype, self.beta_dtype, self.is_varlen,
                self.use_initial_state, self.store_final_state, *self.tiles)

    @property
    def block_DV(self) -> int:
        return self.tiles[0]

    @property
    def store_output(self) -> bool:
        return self.kernel == "loop" or self.tiles[1]

    @property
    def warmup(self) -> bool:
        return self.kernel == "ws" and self.tiles[2]

    @property
    def folded(self) -> bool:
        return self.kernel == "ws" and self.tiles[3:] == (True,)


@dataclass(frozen=True)
class Plan:
    """What one call runs, decided by make_plan. Stage keys are None where the stage does not run.

    cumsum       (chunk, g dtype, gate form) of chunk_local_cumsum on the gate, or None (no gate, or a later stage
                 sums it: kkt_solve the scalar gate with the delta rule, gla_factors the per-channel one); the form
                 is "log" or FLA's in-kernel gate ("softplus", "sigmoid": tilela._gates)
    kkt          (chunk, method, dtype, gate, value heads per pass, gate_in, scaled) of kkt_solve (delta rule,
                 unless gla_factors forms A); gate_in (g dtype, gate form) where it sums the raw scalar gate and
                 writes gc for the state pass, else None; scaled: Ab = A diag(beta) for the warp-specialised pass,
                 A for the loop pass
    kkt_steps    the groups of value heads each kkt_solve CTA runs in turn (kkt_group_steps), or None
    factors      (K, dtype, gate_in, delta rule: writes Kg and A) of gla_factors (per-channel gate on the
                 warp-specialised pass); gate_in: (g dtype, gate form) where it sums the raw gate in its tiles, None
                 where it reads gc
    passes       the state/output launches: (outputs,) unsplit, (transitions, outputs) split
    split        the SegmentPlan of the call's host lengths, or None
    order        the unsplit pass's launch order (launch_order: its sequences longest first), or None (batch order;
                 the split's passes take the segment table's)
    pipeline     the token-range pipeline's boundaries (0, ..., T) over the call's one sequence, or None: gla_factors
                 and the pass range by range, the pass of a range beside the factors of the next (passes: the first
                 range's, then the others', dense, each handing its final state to the next); "auto" takes it only
                 in a CUDA graph's capture (eagerly each range's launches cost more host time than it saves)
    combine      (K, V, transition, reads an initial state, reads the warm-up table) of seq_combine (the split's
                 step 2; transition: the gate kind under the plain update, "matrix" with the delta rule)
    The call's sizes (tokens, sequences, heads) are kept so launch.forward can check its inputs against the plan."""

    gate: str
    delta: bool
    dtype: str
    tokens: int
    lengths: tuple[int, ...]
    H: int
    HV: int
    K: int
    V: int
    initial_state: bool
    output_final_state: bool
    cumsum: tuple | None
    kkt: tuple | None
    kkt_steps: int | None
    factors: tuple | None
    passes: tuple[PassConfig, ...]
    split: SegmentPlan | None
    combine: tuple | None
    order: tuple[int, ...] | None
    pipeline: tuple[int, ...] | None

    @property
    def output(self) -> PassConfig:
        return self.passes[-1]


def kkt_key(chunk: int, method: str, dtype: str, gate: str, group: int, gate_in: tuple | None = None,
            scaled: bool = False) -> tuple:
    """kkt_solve's compile key: two value heads per pass when the GVA group is even (the forward substitution then
    keeps all 128 threads busy), one under a per-channel gate (each value head forms its own scores); gate_in (g
    dtype, gate form) where it sums the raw scalar gate itself, None where it reads gc; scaled where it stores
    Ab = A diag(beta) (the warp-specialised pass's operand)."""
    pair = 2 if group % 2 == 0 and gate != "channel" else 1
    return (chunk, method, dtype, gate, pair, gate_in, scaled)


def kkt_group_steps(lengths, H: int, HV: int, pair: int, sms: int) -> int:
    """The groups of `pair` value heads one kkt_solve CTA runs in turn (K K^T formed once for them), over sequences
    of these lengths (their 64-token tiles) and H q/k heads: all of a q/k head's where tiles x H CTAs number
    KKT_SIDE_BY_SIDE_PER_SM per SM or more, else one, each group in a CTA of its own."""
    groups = -(-(HV // H) // pair)
    return groups if Chains.of(lengths).total * H >= KKT_SIDE_BY_SIDE_PER_SM * sms else 1


def kkt_plan(chunk: int, method: str, dtype: str, gate: str, H: int, HV: int, lengths, sms: int,
             gate_in: tuple | None = None, scaled: bool = False) -> tuple[tuple, int]:
    """kkt_solve's (compile key, group steps) for sequences of these lengths over H q/k and HV value heads on `sms`
    SMs: kkt_key's, then kkt_group_steps' for its value heads per pass. Every launch of kkt_solve (the plan's, the
    public op's) takes both from here."""
    key = kkt_key(chunk, method, dtype, gate, HV // H, gate_in, scaled)
    return key, kkt_group_steps(lengths, H, HV, key[4], sms)


def make_plan(*, lengths, **facts) -> Plan:
    """The plan of one call the pipeline covers (`covers`; the caller checks it first); cached per call facts, so a
    repeated call shape costs one dictionary lookup on the host (the split's cost model alone takes ~0.2 ms).
    Arguments: those of _plan, lengths and a given pipeline's boundaries any iterables of ints."""
    if facts.get("pipeline", "auto") not in ("auto", None):
        facts["pipeline"] = tuple(int(b) for b in facts["pipeline"])
    return _plan(lengths=tuple(int(n) for n in lengths), **facts)


@functools.lru_cache(maxsize=1024)
def _plan(*, dtype: str, beta_dtype: str | None, gate_dtype: str | None, gate: str, delta: bool, H: int, HV: int,
          K: int, V: int, lengths: tuple[int, ...], tokens: int, varlen: bool, scale: float, initial_state: bool,
          output_final_state: bool, sms: int, g_input: str = "raw", gate_form: str = "log", kernel: str = "auto",
          block_DV: int | None = None, split="auto", outputs: bool = True, pipeline="auto",
          graph: bool = False, chunk: int = CHUNK, fold: bool | None = None) -> Plan:
    """make_plan's decisions.

    dtype: q/k/v's ("bfloat16" / "float16"); beta_dtype: beta's as the state pass reads it ("float32" or dtype; None
    without the delta rule); gate_dtype: g's as the stage that sums it reads it ("float32", "bfloat16", "float16"; None without
    a gate); lengths: the host sequence lengths; tokens: B * T.
    The options below serve tests and benchmarks; the ops take the defaults:
    g_input: "raw" (the log gate) or "cumsum" (its chunk-local cumsum already: no cumsum stage).
    gate_form: "log", or FLA's in-kernel gate the stage that sums g forms from it ("softplus", "sigmoid";
    tilela._gates).
    kernel: the state pass, "auto" (ws where it covers), "ws" or "loop". "loop" under the per-channel gate forms
    the scores in the pass and kkt_solve (common.subchunk_scores, kkt_solve.gated_kkt), exact only while no key
    channel decays by more than e^-80 within 16 tokens.
    block_DV: the unsplit ws pass's DV block (one of dv_blocks(K, gate, delta)), default from the cost model.
    split: "auto" (auto_split), None (never) or a SegmentPlan of exactly these lengths.
    pipeline: "auto" (auto_pipeline, in a graph's capture where the plan has gla_factors and no split), None (never)
    or the token boundaries (0, ..., T) of the ranges over the call's one sequence, interior ones at chunk boundaries.
    graph: the call is being captured into a CUDA graph (its launches cost no host time when it replays).
    outputs=False: the state alone (ws pass without its output group; o is not written).
    fold: the ws pass at DV block 128 with the output folded into its two chain groups (chunk_fwd_ws.WsConfig.folded;
    GDN at K = V = 128, with outputs; "auto" split then means none); None: folded where the unsplit pass runs at DV
    block 128 and each q/k head serves several value heads (HV > H), False: never.
    chunk: CHUNK, or SHORT_CHUNK: KDA's short-chunk path (the cumsum at 16, kkt_solve's Neumann inverse at 16, the
    loop pass at 16; no split, no token-range pipeline), under the per-channel gate exact while no key channel
    decays by more than e^-80 within 16 tokens (the bounded gate with lower_bound >= -5); g_input="cumsum" then
    means the cumsum at 16."""
    if g_input not in ("raw", "cumsum"):
        raise ValueError(f"g_input: expected 'raw' or 'cumsum', got {g_input!r}")
    if gate_form not in GATE_FORMS:
        raise ValueError(f"gate_form: expected one of {GATE_FORMS}, got {gate_form!r}")
    if kernel not in ("auto", "ws", "loop"):
        raise ValueError(f"kernel: expected 'auto', 'ws' or 'loop', got {kernel!r}")
    if chunk not in (CHUNK, SHORT_CHUNK) or (chunk == SHORT_CHUNK and (kernel == "ws" or (gate, delta) != (
            "channel", True))):
        raise ValueError(f"chunk: expected {CHUNK}, or {SHORT_CHUNK} for the per-channel delta rule (KDA) on the loop "
                         f"pass, got {chunk} (kernel={kernel!r}, gate {gate!r}, delta rule {delta})")
    ws = ws_covers(dtype, K, V, gate, delta)
    if kernel == "ws" and not ws:
        raise ValueError(f"kernel='ws' covers bf16/fp16 with K = V in (64, 128), got K={K}, V={V}, gate {gate!r}, "
                         f"delta rule {delta}, {dtype}")
    ws = ws and kernel != "loop" and chunk == CHUNK
    if isinstance(split, SegmentPlan):
        if not ws:
            raise ValueError(f"split: the sequence split runs on the warp-specialised pass, got kernel={kernel!r}, "
                             f"K={K}, V={V}, gate {gate!r}, delta rule {delta}")
        if not splits(gate, delta):
            raise ValueError("split: the sequence split takes no per-channel gate without the delta rule (its "
                             "transitions would be diagonal per key channel, not scalar), got a [B, T, HV, K] gate")
        if split.lengths != lengths:
            raise ValueError(f"split: a SegmentPlan of the call's lengths {lengths[:8]}..., got {split.lengths[:8]}...")
    elif split == "auto":
        split = auto_split(lengths, HV, sms, K, gate, delta) if ws and splits(gate, delta) and outputs and not fold \
            else None
    elif split is not None:
        raise ValueError(f"split: expected 'auto', None or a SegmentPlan, got {split!r}")
    rule = update_rule(gate, delta)
    foldable = (ws and delta and gate == "scalar" and K == V == 128 and split is None and outputs
                and block_DV in (None, 128) and pipeline in ("auto", None))
    if fold is None:  # where folding measured faster: the pass at DV 128 with shared q/k heads (benchmarks/NOTES.md)
        chains = Chains.of(lengths)
        fold = foldable and HV > H and (block_DV or default_block_DV(K, V, chains.count * HV, sms, True, rule,
                                                                      chains)) == 128
    if block_DV is not None and (block_DV not in dv_blocks(K, gate, delta) or not ws or split is not None):
        raise ValueError(f"block_DV: the unsplit warp-specialised pass takes one of {dv_blocks(K, gate, delta)}, got "
                         f"{block_DV} (kernel={kernel!r}, warp-specialised: {ws}, split: {split is not None})")
    if fold and not foldable:
        raise ValueError(f"fold: the output folds into the chain groups of GDN's unsplit warp-specialised pass (the "
                         f"delta rule under a scalar gate) at K = V = block_DV = 128, with outputs; got kernel="
                         f"{kernel!r}, gate {gate!r}, delta rule {delta}, K={K}, V={V}, block_DV={block_DV}, split: "
                         f"{split is not None}, outputs={outputs}, pipeline={pipeline!r}")
    if not outputs and not ws:
        raise ValueError(f"outputs=False: the warp-specialised pass alone drops its output group, got kernel="
                         f"{kernel!r}, K={K}, gate {gate!r}, delta rule {delta}")

    beta_dtype = beta_dtype if delta else "float32"
    if gate_form != "log" and (gate == "none" or g_input == "cumsum"):
        raise ValueError(f"gate_form: {gate_form!r} forms the log gate from g, which this plan has not (gate "
                         f"{gate!r}, g_input {g_input!r})")
    # before the ws pass, gla_factors sums the per-channel raw gate in its tiles and, with the delta rule, forms A
    # from its own score operands; the loop pass reads gc, so the cumsum stage makes it there, and kkt_solve A. With
    # the delta rule kkt_solve sums a scalar gate itself and writes gc for the state pass
    gate_in = (gate_dtype, gate_form) if g_input == "raw" else None
    factors = (K, dtype, gate_in, delta) if ws and gate == "channel" else None
    fused = delta and gate == "scalar" and gate_in is not None and chunk == CHUNK
    cumsum = None if gate == "none" or g_input == "cumsum" or factors or fused else (chunk, gate_dtype, gate_form)
    method = "neumann" if chunk == SHORT_CHUNK else "blocked"
    kkt, kkt_steps = kkt_plan(chunk, method, dtype, gate, H, HV, lengths, sms, gate_in if fused else None,
                              scaled=ws) if delta and not factors else (None, None)

    def state_pass(V_pass, chains, varlen_pass, h0, ht, store_output, block=None, warmup=False):
        if not ws:
            tiles = loop_tiles(K, gate, delta, dtype, chunk)
        elif fold:
            tiles = (128, True, False, True)
        else:
            block = block or default_block_DV(K, V_pass, chains.count * HV, sms, store_output, rule, chains)
            tiles = (block, store_output, warmup)
        return PassConfig("ws" if ws else "loop", K, V_pass, float(scale), gate, delta, dtype, beta_dtype,
                          varlen_pass, h0, ht, tiles)

    order = None
    if pipeline == "auto":
        pipeline = None
        if graph and factors and delta and split is None and outputs:
            block = block_DV or default_block_DV(K, V, HV, sms, True, rule, Chains.of(lengths))
            pipeline = auto_pipeline(lengths, HV, sms, K, dtype, gate_form if gate_in else "log", block)
            block_DV = block if pipeline else block_DV
    elif pipeline is not None:
        _check_pipeline(pipeline, lengths, factors is not None and delta and split is None and outputs)
    if pipeline is not None:
        first = state_pass(V, Chains.of(lengths), False, initial_state, True, True, block_DV)
        passes = (first, state_pass(V, Chains.of(lengths), False, True, True, True, first.block_DV))
        combine = None
    elif split is None:
        passes = (state_pass(V, Chains.of(lengths), varlen, initial_state, output_final_state, outputs, block_DV),)
        combine = None
        order = launch_order(lengths, HV * (V // passes[0].block_DV), sms) if varlen else None
    else:
        # transitions: the state alone over every segment from a zero state (plain update: value V, combine after),
        # or from [0 | I] with the value [V | 0], both formed in the pass (delta rule: [B | M] out); outputs from the
        # entering states; under the warm-up both read its table (transitions only where it leaves them, outputs
        # from the warm-up start)
        warmup = warms(gate, delta)
        segments = Chains.of(lengths, split.segment_chunks)
        transitions = state_pass(2 * V if delta else V, segments, True, False, True, False, warmup=warmup)
        warmed = Chains.of(lengths, split.segment_chunks, WARMUP_CHUNKS) if warmup else segments
        passes = (transitions, state_pass(V, warmed, True, True, delta and output_final_state, True, warmup=warmup))
        combine = (K, V, "matrix", initial_state, warmup) if delta else (K, V, gate, initial_state, False)
    return Plan(gate, delta, dtype, int(tokens), lengths, H, HV, K, V, bool(initial_state), bool(output_final_state),
                cumsum, kkt, kkt_steps, factors, passes, split, combine, order, pipeline)


def _check_pipeline(bounds: tuple[int, ...], lengths: tuple[int, ...], runs_factors: bool) -> None:
    """A given pipeline: token boundaries (0, ..., T) of one sequence, interior ones at chunk boundaries, on a plan
    with gla_factors and the delta rule (KDA's), no split and outputs."""
    if not runs_factors or len(lengths) != 1:
        raise ValueError(f"pipeline: the token-range pipeline runs gla_factors' plans (per-channel gate, warp-"
                         f"specialised pass) of one sequence without a split, with outputs; got {len(lengths)} "
                         f"sequences, gla_factors with the delta rule and no split: {runs_factors}")
    inner = bounds[1:-1]
    if (len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != lengths[0] or any(b % CHUNK for b in inner)
            or any(a >= b for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"pipeline: increasing token boundaries from 0 to the sequence's {lengths[0]} tokens, the "
                         f"inner ones multiples of {CHUNK}, got {bounds}")
