"""Chunk forward, state/output pass, warp-specialised (C = 64 rows a chunk): one CTA of four warp groups per (DV
block, sequence, value head). Every group loops over the sequence's chunks; they hand results to each other through
shared-memory rings.

It computes the per-chunk identity of chunk_fwd.py and mirrors the same reference stage
(reference.chunk_math.chunk_forward, over each sequence's chunks in order as reference.seq_in_loop runs it). With a
scalar gate or none:

    Vnew = Ab V - Ab (exp(gc) ⊙ (K S))                delta rule (Ab = A diag(beta): kkt_solve's scaled output;
                                                       the reference's U - W S, U = Ab V, W = Ab (exp(gc) ⊙ K))
    Vnew = V                                           plain update
    O    = scale [exp(gc) ⊙ (Q S) + tril_incl(exp(gc_i - gc_j) ⊙ Q K^T) Vnew]
    S   <- exp(gc_last) S + K^T Vd,                    Vd = exp(gc_last - gc) ⊙ Vnew

With a per-key-channel gate, from the factors gla_factors.py computes beforehand (reference.chunk_math.gated_factors
and wy_form's K ⊙ exp(gc); Qg, Kd and D take the q, k and g slots, Ab = A diag(beta) the A slot, P and Kg come as
their own arguments):

    O    = scale Qg S + P V,       S <- D ⊙ S + Kd^T V,       D = exp(gc_last) per key channel      plain update
    Vnew = Ab V - Ab (Kg S),  O = scale Qg S + P Vnew,  S <- D ⊙ S + Kd^T Vnew                     delta rule (KDA)

Levels served: linear_attn ("none", plain), simple_gla ("scalar", plain), gla ("channel", plain), delta_rule ("none",
delta), GDN ("scalar", delta), KDA ("channel", delta; DV blocks below K: shared memory); K = 256 stays on
chunk_fwd.py.

Warp groups, one macro each in chunk_fwd_ws_kernel (as in FlashAttention 3's hopper/ kernels: the load group is the
producer, state and value the mainloop, output the epilogue):
    state   (threads   0-127)  S in fp32 registers for the whole sequence; per chunk it hands its 16-bit copy to
                               S_s, decays S and adds K^T Vd (K^T V from the input slots where Vd = V)
    value   (threads 128-255)  delta rule: U = Ab V before S is ready, then K S -> X = -exp(gc) K S (in place
                               of V) -> Vnew = U + Ab X -> Vd_s, then Vnew_s (without output: V + X in place of V
                               -> Vnew = Ab (V + X)); under the per-channel gate Kg S for K S and X = -Kg S, and
                               Vnew_s is Vd too; plain update without output: Vd_s; plain update with output:
                               the output of the even chunks; plain update without output or Vd_s: idle
    output  (threads 256-383)  P = Q K^T (before S is ready; loaded with a per-channel gate), Q S, O = ... + P Vnew,
                               stores O (of the odd chunks where the value group takes the even ones; the delta
                               rule's whole chunks through shared memory and TMA, WsConfig.tma_output); without
                               output: idle; folded (WsConfig.folded): only P, into the input slot ("scored")
    chain   (threads 0-255)    the delta rule with output under a scalar gate or none at DV block K, or 64 at K =
                               128 (WsConfig.chains; GDN's and delta_rule's passes, the split's outputs pass
                               included): in place of state and value, one group per 64 columns of the block (two
                               halves at DV block K = 64) each running the state's and the value's work for its
                               columns (each chain is independent of the other); at 64 columns transposed (S^T, X^T,
                               Vnew^T in registers: the recurrence's products take their left operand from
                               registers, K and Ab from shared memory; WsConfig.transposed); one chain group leaves
                               the value group's warps idle; folded, each also forms and stores its columns' O
    load    (threads 384-511)  TMA warp: q (for the output), k, v, A (delta rule), P and Kg (per-channel gate);
                               gate warp: gc (or the chunk's D)
                               loaded GATE_AHEAD chunks ahead into registers, written with exp(gc), exp(gc_last - gc)
                               and the rows' end mask; a last chunk's tail rows zeroed (Tails, below);
                               the other two warps write Vd_s where the value group is an output group, else idle

Hand-overs (Ring): a buffer of n slots, chunk c in slot c % n, one mbarrier pair per slot. "ready" completes when
the slot holds chunk c (a reader waits parity (c // n) % 2), "free" when its readers are done with it (the writer of
chunk c waits parity (c // n + 1) % 2, which a fresh barrier passes: the first n chunks do not wait):
    ready / free         writer -> readers               buffer                     n
    loaded / consumed    load -> the chunk's readers     q, k, v, Ab, gc (D)        2 to 4, 3 delta rule (stages)
    landed               TMA warp -> gate warp           a last chunk's tail bufs   per slot (loaded[n + s]), once
    S_ready / S_read     state -> value, output          S_s                        2
                         (the chain groups -> output)
    Vd_ready / Vd_read   value or Vd writers -> state    Vd_s                       1 delta rule, 2 plain update
                         (none with chain groups: each writes Vd over its X and reads it back, or holds Vd^T)
    Vn_ready / Vn_read   value -> output (and state)     Vnew_s (delta rule)        2 to block_DV = 64, 1 above,
                         (the chain groups -> output)                               2 with chain groups
    scored               output -> the chain groups      P_s (folded: the scores)   the input slots'
The recurrence's critical path is S_s -> K S -> Ab X -> K^T Vd -> S_s (S_s -> Kg S -> Ab (-Kg S) -> K^T Vnew -> S_s
under the per-channel gate; S^T -> S^T K^T -> X^T Ab^T -> Vd^T K -> S^T in registers in the transposed chain groups,
with S_s and Vnew_s written beside it, holding S^T and Vnew^T). P = Q K^T, Q S, P Vnew and the store run
beside it in the output group, a chunk behind at most (two S_s slots: the state never waits for Q S of the chunk it
just left), and the next chunk's loads beside both.

Tails: the 64-row tiles of a sequence's last chunk hold the following sequences' rows (or TMA zeros past the tensor
end). The TMA warp loads that chunk's tail buffers (k, v, A, Kg) on the slot's "landed" barrier; the gate warp waits
for them, zeroes their rows past the sequence end and only then marks the slot loaded, so no product a valid row
takes (K S, Kg S, Ab V, Ab X, K^T Vd, K^T V, P V, P Vnew) meets another sequence's values (0 x NaN is NaN: a mask
by multiplication would let a non-finite input cross); X's rows there are zero (K's are). The column side needs exact
zeros too, and has them: Ab's entries above the diagonal (kkt_solve.py), so its columns past the sequence end for
every live row, and P's (the causal select here, gla_factors.py under the per-channel gate). The q, Qg and P rows
past the end stay: they reach only output rows, which are not stored. exp(gc_last - gc) = 0 there too, and gc is
clamped to the last valid row.

Bounds: every global access is in bounds by construction for the inputs the launcher passes, so the pass compiles
without TileLang's per-access bounds tests (launch.GUARDED): TMA zero-fills a tile's rows past a tensor's end; the
gate warp's rows are clamped into the sequence and its chunks to the last (a CTA of an empty sequence runs none); the
warm-up starts within the sequence (warmup.py: w <= the segment's first chunk) from the row of h0 (the entering
states) or h_init (the initial states) its table names, and stores the final state at the table's row of ht (its
sequence's); o's rows are tested against the sequence end (a whole chunk stored without a test per row, or by TMA,
all its rows before the sequence end; under the warm-up only the chunks from the segment's first row on are
stored); cu_seqlens (non-decreasing up to the token count: checked at the public boundary), the launch order (a
permutation of the sequences), the warm-up table, h0 and ht are read at the CTA's own sequence and head; the
warm-up's transitions read first at indices clamped to its N + 1 entries, cu_seqlens at the segments of the
segment's sequence and the gate's cumsum at chunk ends before the segment, clamped to row 0, and write the table
at the segment's own row.

Glossary:
    plain update   Vnew = V, no delta rule (linear_attn, simple_gla, gla)
    Vd             exp(gc_last - gc) ⊙ Vnew, rows past the sequence end zeroed: the state adds K^T Vd
    direct         (WsConfig.kv_from_inputs, direct_v) the plain update without a scalar gate: Vd = V, so the state
                   group adds K^T V from the input slots and there is no Vd_s; update_rule's key "plain"
    vd             the plain update through a written Vd_s (scalar gate); update_rule's key "vd"
    pingpong       (WsConfig.two_output_groups) the plain update with output: the value group, without products of
                   its own, is a second output group; the two take alternate chunks
    input slots    the loaded / consumed ring's buffers: q_s, k_s, kg_s, v_s, A_s, Pg_s, g_s, eg_s, ed_s, d_s
    NS1, NSL       launch sizes (common.state_pass_contract): len(cu_seqlens), one more than the sequences; the
                   tile slots of the per-channel gate's D
"""

import math
from dataclasses import dataclass
from types import SimpleNamespace

import tilelang
import tilelang.language as T
from tvm.script.ir_builder import IRBuilder

from .common import TILE as CHUNK
from .common import exp_e, extended_value, sequence_of, state_pass_contract
from .plan import update_rule
from .warmup import warmup_row

GROUP = 128  # threads of a warp group
GATES = ("none", "scalar", "channel")
# registers per thread after setmaxnreg, 160 + 152 + 144 + 56 = 512 (65536 over 512 threads, 128 at launch): the
# state group holds S (K x DV / 128 fp32); the load group's gate warp holds GATE_AHEAD chunks of gc (with
# three, GDN at DV 128 in fp16 spills since the tail rows' zeroing); the compile test fails on any spill
STATE_REGS = 160
VALUE_REGS = 152
OUTPUT_REGS = 144
LOAD_REGS = 56
# with two chain groups (WsConfig.chains), 160 + 160 + 136 + 56: each holds its part of S, its K S and Vnew (U
# accumulating there while X is formed) and transposed their 16-bit copies, the register operands; with one, 200 +
# 56 + 144 + 56 (the value group's idle warps at LOAD_REGS leave it room)
CHAIN_REGS = 160
SOLE_CHAIN_REGS = 200
CHAIN_OUTPUT_REGS = 136
# with the output folded into the two chain groups (WsConfig.folded), 208 + 208 + 56 + 40: each chain group holds
# (Q S)^T and O^T where (K S)^T was (at 200 ptxas serialises its products and spills); the scores group half of P's
# columns at a time; the gate warp one chunk's gate loads
FOLDED_CHAIN_REGS = 208
SCORES_REGS = 56
FOLDED_LOAD_REGS = 40
SHARED_BYTES = 226 * 1024  # of the 227 KiB a CTA may take, 1 KiB left for barriers and alignment
GATE_AHEAD = 2  # chunks whose gate loads (gc, D) the gate warp keeps in flight; one folded (its 40 registers)


@dataclass(frozen=True)
class Shared:
    """One shared-memory buffer of the pass: its name in the kernel, its shape (an input buffer's shape leads with
    the input slots) and whether it holds fp32 (the accumulator type) rather than the inputs' 16-bit dtype.
    The builder allocates exactly these buffers, and the input slots are counted from their bytes."""

    name: str
    shape: tuple[int, ...]
    fp32: bool = False

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * (4 if self.fp32 else 2)


@dataclass(frozen=True)
class Ring:
    """A hand-over through a buffer of `slots` slots, chunk c in slot c % slots, with one mbarrier pair per slot
    (the barrier buffers named `ready` and `free`): ready completes when the slot holds chunk c (`writers`
    arrivals), free when its readers are done with it (`readers` arrivals). Pure Python: the methods build the TIR
    expressions of a chunk index c."""

    ready: str
    free: str
    slots: int
    writers: int
    readers: int

    def slot(self, c):
        return c % self.slots

    def ready_parity(self, c):
        """The parity a reader of chunk c waits for on `ready`: the slot's (c // slots)-th fill."""
        return (c // self.slots) % 2

    def free_parity(self, c):
        """The parity the writer of chunk c waits for on `free`: the readers' release of chunk c - slots. A fresh
        barrier passes it, so the first `slots` chunks do not wait."""
        return (c // self.slots + 1) % 2


@dataclass(frozen=True)
class WsConfig:
    """What the pass's builder decides from the head sizes, gate kind, update rule, DV block and output switch
    (the fields up to store_output), derived once (derive); the builder and the shared-memory accounting
    (input_stages) read the same object."""

    K: int
    V: int
    gate: str
    delta: bool
    block_DV: int
    store_output: bool
    NV: int
    """DV blocks, the grid's first dimension: V // block_DV."""
    scalar: bool
    """A scalar gate per row: gc and exp(gc) in the input slots, the state decays by exp(gc_last)."""
    channel: bool
    """A per-key-channel gate: gla_factors.py's factors in the q, k, Pg (and with the delta rule kg) slots, the state
    decays by D per key."""
    two_output_groups: bool
    """The plain update with output ("pingpong"): the value group has no products, so it takes the output of the
    even chunks and the output group that of the odd ones. Each stages its own P; S_s slot c % 2 has one reader."""
    kv_from_inputs: bool
    """The plain update without a scalar gate: Vd = V, so the state group adds K^T V straight from the input slots
    ("direct"); no Vd_s, nobody writes Vd."""
    vd_writers: bool
    """Two otherwise idle load warps write Vd_s = exp(gc_last - gc) V: two output groups and a Vd_s."""
    value_writes_vd: bool
    """The value group writes Vd_s (with the delta rule after X and Vnew, then Vnew_s; Vnew_s alone under
    vnew_is_vd); else it is an output group (two_output_groups), a chain group (chains) or idles (the state
    pass alone with K^T V from the input slots)."""
    chains: int
    """Chain groups (0: the state and value groups). The delta rule with output under a scalar gate or none, at
    block_DV = K (two: halves) or at block_DV = 64 with K = 128 (one): the state and value groups give way to chain
    groups, each running the whole recurrence (S, K S, Ab X, K^T Vd) for block_DV / chains of the block's columns,
    so that no hand-over crosses groups on the recurrence and the SM interleaves independent chains; no Vd_s, and
    the output group waits for every chain group's part of S_s and Vnew_s. One chain group leaves the value group's
    warps idle."""
    transposed: bool
    """Chain groups of 64 columns (K = 128; a warp group's product has 64 rows): they run the recurrence transposed
    (S^T, X^T, Vnew^T, Vd^T in registers), so that each product on the recurrence takes its left operand from
    registers and only K and Ab from shared memory (U^T = V^T Ab^T, off it, both from shared memory); S_s and
    Vnew_s hold S^T and Vnew^T. Otherwise (halves of 32 columns at K = 64) each writes X, then Vd, over its part
    of V in v_s."""
    tma_output: bool
    """The delta rule's output group under a scalar gate or none at DV block 64 or 128 stores a whole chunk's O
    through shared memory and TMA (its first 64 columns staged in P_s, which P Vnew has read, the rest in O_s),
    in place of 32 four-byte stores a thread; a sequence's last chunk, cut by its end, keeps the stores tested row
    by row (a TMA store would write the next sequence's rows)."""
    folded: bool
    """The output folded into the two transposed chain groups (GDN's and delta_rule's pass at K = block_DV = 128):
    each forms its columns' O^T = scale exp(gc) ⊙ (S^T Q^T) + Vnew^T P^T from the S^T and Vnew^T it holds in
    registers and stores it through its own O_s and TMA; the output group's warps form only the scores P = Q K^T
    (causal, exp(gc_i - gc_j)) into the input slot's P_s, marked "scored". Nothing but the input slots crosses groups
    (no S_s, no Vnew_s), which leaves shared memory for three input slots."""
    vnew_is_vd: bool
    """The per-channel delta rule: Vd = Vnew (the decay is in Kd, and Vnew's rows past the sequence end are zero:
    so are Ab's and Kg's there), so the state group adds K^T Vnew from Vnew_s, which the output group reads too;
    no Vd_s and no exp(gc_last - gc) in the input slots."""
    inputs: Ring
    """loaded / consumed: q, k, Kg, v, Ab, P, gc, D from the load group to the groups that read them. Slots: as
    many as shared memory holds beside the fixed buffers, 2 to 4 (3 with the delta rule). Writers: the TMA warp
    and the gate warp (which zeroes a last chunk's tail rows first, module docstring). Readers: the state group,
    the chunk's output group, a value group that writes Vd_s, the Vd writers (the chain groups in place of the
    state and value groups)."""
    S_ring: Ring | None
    """S_ready / S_read: S_s from the state group to the value group (delta rule) and the chunk's output group, or
    from the chain groups (each its part) to the output group; two slots (the state never waits for Q S of the
    chunk it just left). None: S_s has no readers."""
    Vd_ring: Ring | None
    """Vd_ready / Vd_read: Vd_s to the state group from the value group or the two Vd writers (vd_slots). None:
    K^T V from the input slots, Vd = Vnew_s (vnew_is_vd) or each chain group's own Vd (chains)."""
    Vn_ring: Ring | None
    """Vn_ready / Vn_read: Vnew_s from the value group (or the chain groups, each its part) to the output group
    (delta rule with output) and, under vnew_is_vd, the state group; two slots up to block_DV = 64 and with chain
    groups, one above (shared memory). None: no Vnew_s."""
    shared: tuple[Shared, ...]
    """Every shared buffer the builder allocates, in allocation order: the input slots' buffers, then the fixed
    ones (Vnew_s, S_s, Vd_s, P_s, O_s)."""

    @property
    def stages(self) -> int:
        """Input slots."""
        return self.inputs.slots

    @property
    def rings(self) -> tuple[Ring, ...]:
        """The hand-overs that exist, in the order their barriers are allocated."""
        return tuple(ring for ring in (self.inputs, self.S_ring, self.Vd_ring, self.Vn_ring) if ring is not None)

    @classmethod
    def derive(cls, K: int, V: int, gate: str, delta: bool, block_DV: int, store_output: bool,
               folded: bool = False) -> "WsConfig":
        """The configuration of chunk_fwd_ws_kernel's arguments of the same names (V only sets NV)."""
        if gate not in GATES:
            raise ValueError(f"gate: one of {GATES}, got {gate!r}")
        scalar, channel = gate == "scalar", gate == "channel"
        C = CHUNK
        two_output_groups = store_output and not delta
        kv_from_inputs = direct_v(gate, delta)
        vd_writers = two_output_groups and not kv_from_inputs
        vnew_is_vd = channel and delta
        tma_output = delta and not channel and store_output and block_DV in (C, 2 * C)
        chained = delta and not channel and store_output
        chains = 2 if chained and block_DV == K else 1 if chained and (K, block_DV) == (128, 64) else 0
        transposed = chains > 0 and block_DV // chains == 64
        if folded and not (chains == 2 and transposed and tma_output):
            raise ValueError(f"folded: the output folds into two transposed chain groups (the delta rule with output "
                             f"under a scalar gate or none at K = block_DV = 128), got K={K}, block_DV={block_DV}, "
                             f"gate {gate!r}, delta rule {delta}, store_output={store_output}")
        value_writes_vd = not two_output_groups and not kv_from_inputs and not chains
        writers = chains * GROUP if chains else GROUP  # of S_s and Vnew_s
        # warp groups reading S_s: the output group, and the value group unless it is a chain group
        S_readers = 0 if folded else 1 if two_output_groups or chains else int(delta) + int(store_output)
        Vd_slots, Vn_slots = vd_slots(delta), 2 if block_DV <= 64 or chains else 1
        S_ring = Ring("S_ready", "S_read", 2, writers, S_readers * GROUP) if S_readers else None
        Vd_ring = None if kv_from_inputs or vnew_is_vd or chains else Ring(
            "Vd_ready", "Vd_read", Vd_slots, 64 if vd_writers else GROUP, GROUP)
        # the output group (not folded); the state group under vnew_is_vd
        Vn_readers = int(store_output and not folded) + int(vnew_is_vd)
        Vn_ring = Ring("Vn_ready", "Vn_read", Vn_slots, writers, Vn_readers * GROUP) if delta and Vn_readers else None
        slot = [buffer for buffer, used in (  # one input slot of each: q, k, Kg, v, gc, exp(gc), ed, A, P, D
            (Shared("q_s", (C, K)), store_output),
            (Shared("k_s", (C, K)), True),
            (Shared("kg_s", (C, K)), channel and delta),  # Kg = K ⊙ exp(gc) for the value group's Kg S
            (Shared("v_s", (C, block_DV)), True),  # V, overwritten by X (or V + X) in the delta rule
            (Shared("g_s", (C,), fp32=True), scalar),  # gc
            (Shared("eg_s", (C,), fp32=True), scalar),  # exp(gc)
            (Shared("ed_s", (C,), fp32=True), not kv_from_inputs and not vnew_is_vd),  # exp(gc_last - gc), 0 past
            # the sequence end
            (Shared("A_s", (C, C)), delta),  # Ab = A diag(beta): kkt_solve's (scaled) or gla_factors'
            (Shared("Pg_s", (C, C)), channel and store_output),  # the per-channel gate's scores P (gla_factors)
            (Shared("P_s", (C, C)), folded),  # the scores P, formed in the pass for the folded chain groups
            (Shared("d_s", (K,), fp32=True), channel),  # D = exp(gc_last) per key channel
        ) if used]
        fixed = [buffer for buffer, used in (
            (Shared("Vn_s", (Vn_slots, *((block_DV, C) if transposed else (C, block_DV)))), Vn_ring is not None),
            (Shared("S_s", (2, *((block_DV, K) if transposed else (K, block_DV)))), S_ring is not None),
            (Shared("Vd_s", (Vd_slots, C, block_DV)), Vd_ring is not None),
            (Shared("P_s", (2, C, C) if two_output_groups else (C, C)), store_output and not channel and not folded),
            (Shared("O_s", (C, block_DV - C)), tma_output and block_DV > C and not folded),  # O's columns past P_s's
            (Shared("O_s", (chains, C, block_DV // max(chains, 1))), folded),  # each folded chain group's O
        ) if used]
        free = SHARED_BYTES - sum(b.bytes for b in fixed)
        stages = min(3 if delta else 4, free // sum(b.bytes for b in slot))
        if stages < 2:
            raise ValueError(f"block_DV: two input slots of {sum(b.bytes for b in slot)} bytes and the fixed buffers' "
                             f"{SHARED_BYTES - free} exceed the {SHARED_BYTES} bytes of shared memory (K={K}, gate "
                             f"{gate!r}, delta rule {delta}, block_DV={block_DV}); take a smaller DV block")
        return cls(
            K=K, V=V, gate=gate, delta=delta, block_DV=block_DV, store_output=store_output, NV=V // block_DV,
            scalar=scalar, channel=channel, two_output_groups=two_output_groups, kv_from_inputs=kv_from_inputs,
            vd_writers=vd_writers, value_writes_vd=value_writes_vd, chains=chains, transposed=transposed,
            tma_output=tma_output, folded=folded, vnew_is_vd=vnew_is_vd,
            # readers: state and value, or the chain groups; output (not folded: the scores group's reads end
            # before the chain groups' release, which waits for its "scored")
            inputs=Ring("loaded", "consumed", stages, 64,
                        GROUP * ((chains or 1 + int(value_writes_vd)) + int(store_output and not folded))
                        + 64 * int(vd_writers)),
            S_ring=S_ring, Vd_ring=Vd_ring, Vn_ring=Vn_ring,
            shared=tuple(Shared(b.name, (stages, *b.shape), b.fp32) for b in slot) + tuple(fixed),
        )


def allocate_shared(cfg: WsConfig, dtype: str) -> SimpleNamespace:
    """Allocate cfg.shared in its order, each buffer under its name (in dtype, or fp32), then the rings' barriers
    under theirs (and cfg.folded's "scored"), inside the kernel being built; their namespace (smem.q_s, smem.loaded,
    ...)."""
    smem = {buffer.name: IRBuilder.name(buffer.name, T.alloc_shared(buffer.shape, "float32" if buffer.fp32 else dtype))
            for buffer in cfg.shared}
    for ring in cfg.rings:
        # after the input slots' "loaded" barriers, one "landed" per slot (loaded[slots + s]): a last chunk's tail
        # buffers landed (the TMA warp's 32 arrivals and their bytes), used once per CTA; one buffer, so that the
        # TMA warp picks either by index
        landed = [32] * ring.slots if ring is cfg.inputs else []
        smem[ring.ready] = IRBuilder.name(ring.ready, T.alloc_barrier([ring.writers] * ring.slots + landed))
        smem[ring.free] = IRBuilder.name(ring.free, T.alloc_barrier([ring.readers] * ring.slots))
    if cfg.folded:  # per input slot: the scores group has written the chunk's P_s
        smem["scored"] = IRBuilder.name("scored", T.alloc_barrier([GROUP] * cfg.inputs.slots))
    return SimpleNamespace(**smem)


def chunk_fwd_ws_kernel(
    K,
    V,
    scale,
    gate="scalar",
    delta=True,
    dtype="bfloat16",
    beta_dtype="float32",
    is_varlen=False,
    use_initial_state=False,
    store_final_state=False,
    block_DV=128,
    store_output=True,
    warmup=False,
    folded=False,
):
    """Build the warp-specialised state/output pass for static head sizes (K in {64, 128}; V = K, or 2K for the
    sequence split's delta-rule transitions: the state alone from [0 | I] with the value [v | 0], v of K columns, both
    formed here: the DV blocks past column K load v's columns past its end, which TMA fills with zeros, and their
    state starts from the identity), gate kind (GATES), update rule and DV block (dv_blocks(K); below K for the
    per-channel delta rule at K = 128).  Batch, length, head counts and the varlen layout are dynamic.
    Grid: (V // block_DV, HV, N sequences in the launch order), 512 threads.  Inputs absent for a configuration (g
    without a gate; A for the plain update) are one-element placeholders, and beta is not read (the delta rule's
    A is Ab = A diag(beta)).  store_output=False drops the
    output group (its warps idle, o is not written): the state pass alone, as the sequence split's transitions need
    it.
    warmup (varlen, the sequence split's passes with the warm-up table in warm, hopper/warmup.py): with output, a
    segment's CTA starts warm[0] chunks before it (none where -1) from h0[warm[1]] (zero where -1, the call's
    initial state h_init[-2 - warm[1]] where below), stores o from the segment's first row and its final state at
    ht[warm[2]] (a sequence's at its last segment; the others' all at one row no one reads); without output (the
    transitions) each CTA first forms its segment's row of the table (warmup.py, from first, max_chunks and
    initial) and runs no chunk where the row's w is not -1 (its entering state comes from the warm-up).
    folded: the output formed by the two chain groups (WsConfig.folded; GDN and delta_rule at K = block_DV = 128,
    without the warm-up)."""
    if warmup and not is_varlen:
        raise ValueError("warmup: the warm-up table indexes the split's segments, a varlen layout; got is_varlen=False")
    if warmup and gate == "channel":  # D's tile slots are the segments'; a warm-up would read them shifted
        raise ValueError("warmup: the warm-up serves the scalar gate's split (warmup.py), got gate 'channel'")
    extended = extended_value(K, V)  # the split's transitions: [v | 0] from [0 | I]
    if extended and (store_output or use_initial_state or not delta):
        raise ValueError(f"V: 2K is the delta rule's transitions (the state alone from [0 | I] formed here), got "
                         f"store_output={store_output}, use_initial_state={use_initial_state}, delta={delta}")
    if warmup and folded:
        raise ValueError("folded: the output folds into the chain groups of the unsplit pass, got warmup=True")
    cfg = WsConfig.derive(K, V, gate, delta, block_DV, store_output, folded)
    C, accum = CHUNK, "float32"
    scalar, channel = cfg.scalar, cfg.channel
    inputs, S_ring, Vd_ring, Vn_ring = cfg.inputs, cfg.S_ring, cfg.Vd_ring, cfg.Vn_ring
    sig = state_pass_contract(K, V, gate, delta, dtype, beta_dtype, scores=channel, warmup=warmup)
    B, Tn, H, HV, NS1 = sig.B, sig.Tn, sig.H, sig.HV, sig.NS1

    # The warp groups. smem: the shared buffers and barriers (allocate_shared); cta: this CTA's coordinates (bb,
    # bn, bh, hq, v0, t_start, t_end, tile0, n_chunks); the fragments and global tensors each group uses.

    @T.macro
    def publish(smem, ring, c, frag, buffer, j0, cols):
        """Hand chunk c's fragment to the ring's readers: wait until its slot of buffer is free, copy it to the
        slot's columns j0 ... j0 + cols (its rows under cfg.transposed: S^T, Vnew^T), mark it ready."""
        n = ring.slot(c)
        T.barrier_wait(getattr(smem, ring.free)[n], ring.free_parity(c))
        if cfg.transposed:
            T.copy(frag, buffer[n, j0 : j0 + cols, :])
        else:
            T.copy(frag, buffer[n, :, j0 : j0 + cols])
        T.fence_proxy_async()
        T.barrier_arrive(getattr(smem, ring.ready)[n])

    def correction_entry(smem, slot, i, KS):
        """X's entry at row i from K S's: -exp(gc_i) (K S)_i. (-(K S)_i without a gate; -(Kg S)_i under the
        per-channel gate, whose K S is Kg S)."""
        return -(smem.eg_s[slot, i] * KS) if scalar else -KS

    @T.macro
    def correction(smem, slot, X_f, j0, cols, X16=None, plus_v=False):
        """X = -exp(gc) K S from K S in X_f, the delta rule's Vnew = U + Ab X with U = Ab V: formed in X_f and
        written over the input slot's V columns j0 ... j0 + cols in the inputs' dtype (U formed from them first;
        plus_v: V + X, for Vnew = Ab (V + X)), or transposed (X_f holding (K S)^T) into X16 as X^T."""
        if X16 is None:
            for i, j in T.Parallel(C, cols):
                if plus_v:
                    X_f[i, j] = smem.v_s[slot, i, j0 + j] + correction_entry(smem, slot, i, X_f[i, j])
                else:
                    X_f[i, j] = correction_entry(smem, slot, i, X_f[i, j])
            T.copy(X_f, smem.v_s[slot, :, j0 : j0 + cols])
        else:
            for j, i in T.Parallel(cols, C):
                X16[j, i] = T.cast(correction_entry(smem, slot, i, X_f[j, i]), dtype)

    @T.macro
    def scalar_decay(smem, slot, decay, S_f):
        """S_f <- exp(gc_last) S_f under a scalar gate (decay: a one-element local buffer; S_f: S or S^T)."""
        decay[0] = smem.eg_s[slot, C - 1]
        for i, j in T.Parallel(*S_f.shape):
            S_f[i, j] = S_f[i, j] * decay[0]

    @T.macro
    def write_vd(smem, c, slot, Vn_f):
        """Hand chunk c's Vd = exp(gc_last - gc) Vnew (V without the delta rule: Vn_f None) to the state group."""
        T.barrier_wait(smem.Vd_read[Vd_ring.slot(c)], Vd_ring.free_parity(c))
        for i, j in T.Parallel(C, block_DV):
            smem.Vd_s[Vd_ring.slot(c), i, j] = smem.ed_s[slot, i] * (Vn_f[i, j] if delta else smem.v_s[slot, i, j])
        T.fence_proxy_async()
        T.barrier_arrive(smem.Vd_ready[Vd_ring.slot(c)])

    @T.macro
    def load_state(S_f, h0, n, bh, v0, cols):
        """S_f <- columns v0 ... v0 + cols of state n of h0 (S^T under cfg.transposed)."""
        if cfg.transposed:
            for j, i in T.Parallel(cols, K):
                S_f[j, i] = h0[n, bh, i, v0 + j]
        else:
            T.copy(h0[n, bh, 0:K, v0 : v0 + cols], S_f)

    @T.macro
    def store_state(S_f, ht, n, bh, v0, cols):
        """Columns v0 ... v0 + cols of state n of ht <- S_f (S^T under cfg.transposed)."""
        if cfg.transposed:
            for j, i in T.Parallel(cols, K):
                ht[n, bh, i, v0 + j] = S_f[j, i]
        else:
            T.copy(S_f, ht[n, bh, 0:K, v0 : v0 + cols])

    @T.macro
    def final_state(cta, S_f, ht, v0, cols):
        """The final state of columns v0 ... v0 + cols into ht: at the CTA's sequence, or under the warm-up with
        output at the table's row (read after the chunk loop, so that no register holds it through the loop; every
        segment has one, so the store takes no branch)."""
        store_state(S_f, ht, cta.warm[2, cta.bn, cta.bh] if warmup and store_output else cta.bn, cta.bh, v0, cols)

    @T.macro
    def initial_state(cta, S_f, h0, h_init, v0, cols):
        """S_f <- the entering state of columns v0 ... v0 + cols (S^T under cfg.transposed): the state the warm-up
        table names (h0's row, h_init's row, or zero), h0, the transitions' [0 | I] or zero."""
        if warmup and store_output:
            if cta.h0_row >= 0:
                load_state(S_f, h0, cta.h0_row, cta.bh, v0, cols)
            elif cta.h0_row <= -2:
                load_state(S_f, h_init, -2 - cta.h0_row, cta.bh, v0, cols)
            else:
                T.clear(S_f)
        elif use_initial_state:
            load_state(S_f, h0, cta.bn, cta.bh, v0, cols)
        elif extended:  # [0 | I]: column K + i of row i
            for i, j in T.Parallel(K, cols):
                S_f[i, j] = T.if_then_else(v0 + j == K + i, 1.0, 0.0)
        else:
            T.clear(S_f)

    @T.macro
    def state_group(smem, cta, S_f, h0, ht, h_init):
        """S for the whole sequence: per chunk, hand its 16-bit copy to S_s, decay S, add K^T Vd (or K^T V)."""
        decay = T.alloc_local([1], accum)
        initial_state(cta, S_f, h0, h_init, cta.v0, block_DV)
        for c in T.serial(cta.n_chunks):
            slot = inputs.slot(c)
            T.barrier_wait(smem.loaded[slot], inputs.ready_parity(c))
            if S_ring is not None:
                publish(smem, S_ring, c, S_f, smem.S_s, 0, block_DV)
            if scalar:
                scalar_decay(smem, slot, decay, S_f)
            if channel:
                for i, j in T.Parallel(K, block_DV):
                    S_f[i, j] = S_f[i, j] * smem.d_s[slot, i]
            if cfg.kv_from_inputs:
                T.gemm(smem.k_s[slot, :, :], smem.v_s[slot, :, :], S_f, transpose_A=True)
            elif cfg.vnew_is_vd:
                T.barrier_wait(smem.Vn_ready[Vn_ring.slot(c)], Vn_ring.ready_parity(c))
                T.gemm(smem.k_s[slot, :, :], smem.Vn_s[Vn_ring.slot(c), :, :], S_f, transpose_A=True)
                T.barrier_arrive(smem.Vn_read[Vn_ring.slot(c)])
            else:
                T.barrier_wait(smem.Vd_ready[Vd_ring.slot(c)], Vd_ring.ready_parity(c))
                T.gemm(smem.k_s[slot, :, :], smem.Vd_s[Vd_ring.slot(c), :, :], S_f, transpose_A=True)
                T.barrier_arrive(smem.Vd_read[Vd_ring.slot(c)])
            T.barrier_arrive(smem.consumed[slot])
        if store_final_state:
            final_state(cta, S_f, ht, cta.v0, block_DV)

    @T.macro
    def value_group(smem, cta, KS_f, Vn_f):
        """Per chunk, the delta rule's U = Ab V before S is ready, then K S -> X = -exp(gc) K S (in place of V) ->
        Vnew = U + Ab X, the chain groups' rounding (so a pass's outputs do not depend on its DV block), then Vd_s =
        exp(gc_last - gc) Vnew and Vnew_s; under vnew_is_vd the same with Kg S for K S, and Vnew_s is Vd too.
        Without output (the split's transitions, at DV blocks where U and K S at once would hold two DV-wide
        accumulators) K S -> V + X (in place of V) -> Vnew = Ab (V + X). Under the plain update Vd_s = exp(gc_last -
        gc) V alone."""
        u_first = cfg.vnew_is_vd or cfg.store_output
        for c in T.serial(cta.n_chunks):
            slot = inputs.slot(c)
            T.barrier_wait(smem.loaded[slot], inputs.ready_parity(c))
            if delta:
                s = S_ring.slot(c)
                if u_first:  # U while the state group finishes the chunk before
                    T.gemm(smem.A_s[slot, :, :], smem.v_s[slot, :, :], Vn_f, clear_accum=True)
                T.barrier_wait(smem.S_ready[s], S_ring.ready_parity(c))
                T.gemm(smem.kg_s[slot, :, :] if channel else smem.k_s[slot, :, :], smem.S_s[s, :, :], KS_f,
                       clear_accum=True)
                T.barrier_arrive(smem.S_read[s])
                correction(smem, slot, KS_f, 0, block_DV, plus_v=not u_first)
                T.fence_proxy_async()
                T.gemm(smem.A_s[slot, :, :], smem.v_s[slot, :, :], Vn_f, clear_accum=not u_first)
            if not cfg.vnew_is_vd:
                write_vd(smem, c, slot, Vn_f)  # first: Vd is on the recurrence's critical path, Vnew_s is not
            if Vn_ring is not None:
                publish(smem, Vn_ring, c, Vn_f, smem.Vn_s, 0, block_DV)
            T.barrier_arrive(smem.consumed[slot])

    @T.macro
    def transposed_chunk(smem, cta, c, slot, j0, S_f, X_f, Vn_f, S16, X16, Vd16, decay, o):
        """One chunk of a transposed chain group (cfg.transposed; S_f, X_f, Vn_f hold S^T, (K S)^T, Vnew^T and S16,
        X16, Vd16 the 16-bit S^T, X^T, Vd^T): (K S)^T = S^T K^T, then U^T = V^T Ab^T issued while X^T is formed,
        Vnew^T = U^T + X^T Ab^T, S^T <- exp(gc_last) S^T + Vd^T K, each product taking its left operand from
        registers; S^T and Vnew^T to its rows of S_s and Vnew_s, Vnew's hand-over and the decay while a product runs.
        Folded (cfg.folded), in place of the hand-overs its columns' O^T = scale exp(gc) ⊙ (S^T Q^T) + Vnew^T P^T from
        the same register operands, accumulated in X_f once X^T has left it ((Q S)^T issued after Vnew^T's product,
        Vnew^T P^T with Vnew^T in X16 after the scores group's "scored"), stored through its O_s by TMA (a sequence's
        last chunk cut by its end row by row); the slot is released before the stores."""
        cols = block_DV // cfg.chains
        if cfg.folded:
            T.tma_store_wait()  # the chunk before's O has left O_s (the group's barrier before O_s's stores follows)
        T.copy(S_f, S16)
        if not cfg.folded:
            # before (K S)^T: a register operand is not to be read while its product runs (PTX), and nvcc
            # would store S16's registers for S_f's identical copy
            publish(smem, S_ring, c, S16, smem.S_s, j0, cols)
        T.gemm(S16, smem.k_s[slot, :, :], X_f, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(smem.v_s[slot, :, j0 : j0 + cols], smem.A_s[slot, :, :], Vn_f, transpose_A=True,
                     transpose_B=True, clear_accum=True)  # U^T, while X^T is formed
        correction(smem, slot, X_f, j0, cols, X16)
        T.wgmma_gemm(X16, smem.A_s[slot, :, :], Vn_f, transpose_B=True)
        if cfg.folded:
            T.wgmma_gemm(S16, smem.q_s[slot, :, :], X_f, transpose_B=True, clear_accum=True)  # (Q S)^T
        if scalar:
            scalar_decay(smem, slot, decay, S_f)
        T.wait_wgmma(0)
        for j, i in T.Parallel(cols, C):
            Vd16[j, i] = T.cast(smem.ed_s[slot, i] * Vn_f[j, i], dtype)
            if cfg.folded:
                X16[j, i] = T.cast(Vn_f[j, i], dtype)
        T.wgmma_gemm(Vd16, smem.k_s[slot, :, :], S_f)
        if cfg.folded:
            for j, i in T.Parallel(cols, C):
                X_f[j, i] = X_f[j, i] * (scale * smem.eg_s[slot, i] if scalar else scale)
            T.barrier_wait(smem.scored[slot], inputs.ready_parity(c))
            T.wgmma_gemm(X16, smem.P_s[slot, :, :], X_f, transpose_B=True)
        else:
            publish(smem, Vn_ring, c, Vn_f, smem.Vn_s, j0, cols)
        T.wait_wgmma(0)
        if cfg.folded:
            T.barrier_arrive(smem.consumed[slot])  # the stores below read registers and O_s only
            t0 = cta.t_start + c * C
            n = j0 // cols
            if t0 + C <= cta.t_end:  # a whole chunk of the sequence, through O_s and TMA
                for j, i in T.Parallel(cols, C):
                    smem.O_s[n, i, j] = X_f[j, i]
                T.fence_proxy_async()
                T.tma_copy(smem.O_s[n, :, :], o[cta.bb, t0 : t0 + C, cta.bh, cta.v0 + j0 : cta.v0 + j0 + cols])
            else:
                for j, i in T.Parallel(cols, C):
                    if t0 + i < cta.t_end:
                        o[cta.bb, t0 + i, cta.bh, cta.v0 + j0 + j] = X_f[j, i]

    @T.macro
    def chain_group(smem, cta, j0, S_f, X_f, Vn_f, S16, X16, Vd16, h0, ht, h_init, o):
        """The whole recurrence for columns j0 ... j0 + block_DV / chains of the DV block (cfg.chains): per chunk,
        S's 16-bit copy to its part of S_s, U = Ab V beside K S -> X = -exp(gc) K S -> Vnew = U + Ab X -> Vd =
        exp(gc_last - gc) Vnew, S <- exp(gc_last) S + K^T Vd; Vnew to its part of Vnew_s. V enters the chain only
        through U's product (from shared memory), so no register waits for it. Transposed (cfg.transposed, folded
        or not): transposed_chunk. Otherwise (S16, X16, Vd16 None) U is issued first, K S reads its columns of S_s,
        and X and then Vd pass through its part of V in v_s (over V, once U has read it)."""
        cols = block_DV // cfg.chains
        decay = T.alloc_local([1], accum)
        initial_state(cta, S_f, h0, h_init, cta.v0 + j0, cols)
        for c in T.serial(cta.n_chunks):
            slot = inputs.slot(c)
            T.barrier_wait(smem.loaded[slot], inputs.ready_parity(c))
            if cfg.transposed:
                transposed_chunk(smem, cta, c, slot, j0, S_f, X_f, Vn_f, S16, X16, Vd16, decay, o)
            else:
                T.wgmma_gemm(smem.A_s[slot, :, :], smem.v_s[slot, :, j0 : j0 + cols], Vn_f, clear_accum=True)  # U
                publish(smem, S_ring, c, S_f, smem.S_s, j0, cols)
                T.gemm(smem.k_s[slot, :, :], smem.S_s[S_ring.slot(c), :, j0 : j0 + cols], X_f,
                       clear_accum=True)  # waits for U too
                correction(smem, slot, X_f, j0, cols)
                T.fence_proxy_async()
                T.gemm(smem.A_s[slot, :, :], smem.v_s[slot, :, j0 : j0 + cols], Vn_f)
                for i, j in T.Parallel(C, cols):
                    smem.v_s[slot, i, j0 + j] = smem.ed_s[slot, i] * Vn_f[i, j]
                T.fence_proxy_async()
                if scalar:
                    scalar_decay(smem, slot, decay, S_f)
                T.gemm(smem.k_s[slot, :, :], smem.v_s[slot, :, j0 : j0 + cols], S_f, transpose_A=True)
                publish(smem, Vn_ring, c, Vn_f, smem.Vn_s, j0, cols)
            if not cfg.folded:  # (transposed_chunk releases the slot before its stores)
                T.barrier_arrive(smem.consumed[slot])
        if cfg.folded:  # the last O's TMA store has read O_s before the CTA's shared memory goes
            T.tma_store_wait()
        if store_final_state:
            final_state(cta, S_f, ht, cta.v0 + j0, cols)

    @T.macro
    def scores(smem, slot, P_f, P_s):
        """P = scale tril_incl(exp(gc_i - gc_j) ⊙ Q K^T) of the input slot's chunk (no gate: scale tril_incl(Q K^T))
        into P_s, in the inputs' dtype, by blocks of P_f's columns: a (C, C) P_s whole, or in halves (the folded
        scores group's registers hold half of P's) into the slot's columns of the input slots' P_s."""
        cols = P_f.shape[1]
        for j0 in T.unroll(0, C, cols):
            T.gemm(smem.q_s[slot, :, :], smem.k_s[slot, j0 : j0 + cols, :], P_f, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, cols):
                if scalar:
                    P_f[i, j] = T.if_then_else(
                        j0 + j <= i, P_f[i, j] * scale * exp_e(smem.g_s[slot, i] - smem.g_s[slot, j0 + j]), 0
                    )
                else:
                    P_f[i, j] = T.if_then_else(j0 + j <= i, P_f[i, j] * scale, 0)
            T.copy(P_f, P_s if cols == C else P_s[slot, :, j0 : j0 + cols])

    @T.macro
    def scores_group(smem, cta, P_f):
        """Folded (cfg.folded): every chunk's scores P into its input slot's P_s for the chain groups' Vnew^T P^T,
        marked "scored". The group does not release the slot: the chain groups do, after "scored"."""
        for c in T.serial(cta.n_chunks):
            slot = inputs.slot(c)
            T.barrier_wait(smem.loaded[slot], inputs.ready_parity(c))
            scores(smem, slot, P_f, smem.P_s)
            T.fence_proxy_async()
            T.barrier_arrive(smem.scored[slot])

    @T.macro
    def output_chunk(c, P_s, P_f, O_f, smem, o, bb, bh, v0, t_start, t_out, t_end):
        """Chunk c's output by one output group: P = Q K^T (before S is ready; loaded under the per-channel gate),
        O = scale (Q S) (exp(gc) rows) + P Vnew, stored to o's rows up to t_end. Under the warm-up a chunk before
        t_out (the segment's first row; the CTA starts whole chunks before it) has no output: the group passes its
        hand-overs on without products or stores. P_s: the group's P staging (and O's under cfg.tma_output); P_f,
        O_f: its fragments."""
        s, slot = S_ring.slot(c), inputs.slot(c)
        t0 = t_start + c * C
        live = (t0 >= t_out) if warmup else True
        T.barrier_wait(smem.loaded[slot], inputs.ready_parity(c))
        if not channel and live:
            if cfg.tma_output:  # the chunk before's O has left P_s and O_s (the group's barrier before P_s's
                T.tma_store_wait()  # stores follows: TileLang's, for P Vnew's read of P_s)
            scores(smem, slot, P_f, P_s)
            T.fence_proxy_async()
        T.barrier_wait(smem.S_ready[s], S_ring.ready_parity(c))
        if live:
            T.gemm(smem.q_s[slot, :, :], smem.S_s[s, :, :], O_f, transpose_B=cfg.transposed, clear_accum=True)
        T.barrier_arrive(smem.S_read[s])
        if live:
            for i, j in T.Parallel(C, block_DV):
                if scalar:
                    O_f[i, j] = O_f[i, j] * (scale * smem.eg_s[slot, i])
                else:
                    O_f[i, j] = O_f[i, j] * scale
        if delta:
            n = Vn_ring.slot(c)
            T.barrier_wait(smem.Vn_ready[n], Vn_ring.ready_parity(c))
            if live:
                T.gemm(smem.Pg_s[slot, :, :] if channel else P_s, smem.Vn_s[n, :, :], O_f,
                       transpose_B=cfg.transposed)
            T.barrier_arrive(smem.Vn_read[n])
        elif live:
            T.gemm(smem.Pg_s[slot, :, :] if channel else P_s, smem.v_s[slot, :, :], O_f)
        T.barrier_arrive(smem.consumed[slot])  # the stores below read registers, P_s and O_s only
        if live:
            if t0 + C <= t_end:  # a whole chunk of the sequence: its rows stored without a test per row
                if cfg.tma_output:  # through P_s (O_s) and TMA
                    T.copy(O_f[:, 0:C], P_s)
                    if block_DV > C:
                        T.copy(O_f[:, C:block_DV], smem.O_s)
                    # the group's writes seen by the async proxy; TileLang puts the group's barrier before the
                    # store, which one elected lane issues
                    T.fence_proxy_async()
                    T.tma_copy(P_s, o[bb, t0 : t0 + C, bh, v0 : v0 + C])
                    if block_DV > C:
                        T.tma_copy(smem.O_s, o[bb, t0 : t0 + C, bh, v0 + C : v0 + block_DV])
                else:
                    for i, j in T.Parallel(C, block_DV):
                        o[bb, t0 + i, bh, v0 + j] = O_f[i, j]
            else:
                for i, j in T.Parallel(C, block_DV):
                    if t0 + i < t_end:
                        o[bb, t0 + i, bh, v0 + j] = O_f[i, j]

    @T.macro
    def output_group(first, P_f, O_f, smem, cta, o):
        """The output of every chunk, or with two output groups of chunks first, first + 2, ... (S_s slot c % 2 is
        read by chunk c's group only; each group stages its P in its own P_s slot, first)."""
        if cfg.two_output_groups:
            for cc in T.serial(T.ceildiv(cta.n_chunks - first, 2)):
                output_chunk(2 * cc + first, None if channel else smem.P_s[first, :, :], P_f, O_f, smem, o, cta.bb,
                             cta.bh, cta.v0, cta.t_start, cta.t_out, cta.t_end)
        else:
            for c in T.serial(cta.n_chunks):
                output_chunk(c, None if channel else smem.P_s, P_f, O_f, smem, o, cta.bb, cta.bh, cta.v0, cta.t_start,
                             cta.t_out, cta.t_end)
            if cfg.tma_output:  # the last O's TMA stores have read P_s and O_s before the CTA's shared memory goes
                T.tma_store_wait()

    @T.macro
    def tma_warp(smem, cta, q, k, v, A, kg, P):
        """The TMA loads of every chunk's q (for the output), k, v, A (delta rule), Kg (per-channel delta rule) and
        P (per-channel gate, with output) into its input slot; a last chunk's tail buffers on "landed", where the
        gate warp zeroes their rows past the sequence end before it marks the slot loaded."""
        for c in T.serial(cta.n_chunks):
            slot = inputs.slot(c)
            t0 = cta.t_start + c * C
            T.barrier_wait(smem.consumed[slot], inputs.free_parity(c))
            if store_output:
                T.tma_copy(q[cta.bb, t0 : t0 + C, cta.hq, :], smem.q_s[slot, :, :], barrier=smem.loaded[slot])
            if channel and store_output:
                T.tma_copy(P[cta.bb, t0 : t0 + C, cta.bh, :], smem.Pg_s[slot, :, :], barrier=smem.loaded[slot])
            bar = slot + inputs.slots * T.if_then_else(t0 + C > cta.t_end, 1, 0)  # landed for a tail, else loaded
            T.tma_copy(k[cta.bb, t0 : t0 + C, cta.hq, :], smem.k_s[slot, :, :], barrier=smem.loaded[bar])
            T.tma_copy(v[cta.bb, t0 : t0 + C, cta.bh, cta.v0 : cta.v0 + block_DV], smem.v_s[slot, :, :],
                       barrier=smem.loaded[bar])
            if delta:
                T.tma_copy(A[cta.bb, t0 : t0 + C, cta.bh, :], smem.A_s[slot, :, :], barrier=smem.loaded[bar])
            if channel and delta:
                T.tma_copy(kg[cta.bb, t0 : t0 + C, cta.bh, :], smem.kg_s[slot, :, :], barrier=smem.loaded[bar])
            if t0 + C > cta.t_end:
                T.barrier_arrive(smem.loaded[bar])
            T.barrier_arrive(smem.loaded[slot])

    @T.macro
    def fetch_gate_rows(u, c, regs, lane, cta, g):
        """The gate warp's loads of chunk c (clamped to the last chunk: the loads past it are harmless repeats)
        into register set u: gc of rows lane and lane + 32 (clamped to the sequence's last row) and gc_last, or the
        chunk's D under the per-channel gate. They stay in flight until the chunk's slot is written."""
        t0 = cta.t_start + T.min(c, cta.n_chunks - 1) * C
        if scalar:
            for r in T.unroll(C // 32):
                regs.g_r[u, r] = g[cta.bb, T.min(t0 + lane + 32 * r, cta.t_end - 1), cta.bh]
            regs.g_last[u] = g[cta.bb, T.min(t0 + C - 1, cta.t_end - 1), cta.bh]
        if channel:
            for e in T.unroll(K // 32):
                regs.d_r[u, e] = g[cta.tile0 + T.min(c, cta.n_chunks - 1), cta.bh, lane + 32 * e]

    @T.macro
    def zero_tail_rows(smem, slot, rows):
        """Zero the tail buffers' rows from `rows` on in an input slot (the gate warp)."""
        for i, j in T.Parallel(C, K):
            if i >= rows:
                smem.k_s[slot, i, j] = 0
        for i, j in T.Parallel(C, block_DV):
            if i >= rows:
                smem.v_s[slot, i, j] = 0
        if delta:
            for i, j in T.Parallel(C, C):
                if i >= rows:
                    smem.A_s[slot, i, j] = 0
        if channel and delta:
            for i, j in T.Parallel(C, K):
                if i >= rows:
                    smem.kg_s[slot, i, j] = 0

    @T.macro
    def gate_warp(smem, cta, lane, g):
        """Rows lane and lane + 32 of every chunk's gc, exp(gc), exp(gc_last - gc) (or only its end mask) and D,
        from loads issued GATE_AHEAD chunks ahead (folded: one) into registers; a last chunk's tail buffers zeroed
        past the sequence end once they land."""
        # registers of the `ahead` chunks whose loads are in flight (chunk c in set c % ahead)
        ahead = 1 if cfg.folded else GATE_AHEAD
        g_r = T.alloc_local([ahead, C // 32], accum)
        g_last = T.alloc_local([ahead], accum)
        d_r = T.alloc_local([ahead, K // 32], accum)
        regs = SimpleNamespace(g_r=g_r, g_last=g_last, d_r=d_r)
        for u in T.unroll(ahead):
            if u < cta.n_chunks:
                fetch_gate_rows(u, u, regs, lane, cta, g)
        for cc in T.serial(T.ceildiv(cta.n_chunks, ahead)):
            for u in T.unroll(ahead):
                c = cc * ahead + u
                if c < cta.n_chunks:
                    slot = inputs.slot(c)
                    t0 = cta.t_start + c * C
                    T.barrier_wait(smem.consumed[slot], inputs.free_parity(c))
                    for r in T.unroll(C // 32):
                        i = lane + 32 * r
                        if scalar:
                            smem.g_s[slot, i] = g_r[u, r]
                            smem.eg_s[slot, i] = exp_e(g_r[u, r])
                            smem.ed_s[slot, i] = T.if_then_else(t0 + i < cta.t_end, exp_e(g_last[u] - g_r[u, r]), 0)
                        elif not cfg.kv_from_inputs and not cfg.vnew_is_vd:
                            smem.ed_s[slot, i] = T.if_then_else(t0 + i < cta.t_end, 1, 0)
                    if channel:
                        for e in T.unroll(K // 32):
                            smem.d_s[slot, lane + 32 * e] = d_r[u, e]
                    if t0 + C <= cta.t_end:  # a tail's slot is marked loaded below, once its rows are zeroed
                        T.barrier_arrive(smem.loaded[slot])
                    fetch_gate_rows(u, c + ahead, regs, lane, cta, g)
        # the last chunk when it is a tail, after the loop: the gate registers are dead there, so the zeroing's
        # address arithmetic fits the load group's register budget
        last = cta.t_start + (cta.n_chunks - 1) * C
        if cta.n_chunks > 0 and last + C > cta.t_end:
            T.barrier_wait(smem.loaded[inputs.slots + inputs.slot(cta.n_chunks - 1)], 0)
            zero_tail_rows(smem, inputs.slot(cta.n_chunks - 1), cta.t_end - last)
            T.fence_proxy_async()
            T.barrier_arrive(smem.loaded[inputs.slot(cta.n_chunks - 1)])

    @T.macro
    def vd_writers(smem, cta):
        """Vd = exp(gc_last - gc) V (rows past the end zeroed) for the state group, from the input slots."""
        for c in T.serial(cta.n_chunks):
            slot = inputs.slot(c)
            T.barrier_wait(smem.loaded[slot], inputs.ready_parity(c))
            write_vd(smem, c, slot, None)
            T.barrier_arrive(smem.consumed[slot])

    @T.prim_func
    def chunk_fwd_ws(q: sig.q, k: sig.k, v: sig.v, g: sig.g, beta: sig.beta, A: sig.A, h0: sig.h0,
                     cu_seqlens: sig.cu_seqlens, o: sig.o, ht: sig.ht, kg: sig.kg, P: sig.P, warm: sig.warm,
                     order: sig.order, h_init: sig.h_init, first: sig.first,
                     max_chunks: sig.max_chunks, initial: sig.initial):
        with T.Kernel(cfg.NV, HV, (NS1 - 1) if is_varlen else B, threads=4 * GROUP) as (bv, bh, bz):
            bn = T.alloc_var("int32")
            bn = sequence_of(sig, order, bz) if is_varlen else bz
            hq = bh // (HV // H)
            v0 = bv * block_DV
            smem = allocate_shared(cfg, dtype)
            S_f = KS_f = Vn_f = O_f = P_f = O2_f = P2_f = parts = None
            part = block_DV // max(cfg.chains, 1)  # a chain group's columns
            if cfg.transposed:  # each chain group's S^T, (K S)^T, Vnew^T in fp32 and its operands S^T, X^T, Vd^T
                parts = [tuple(T.alloc_fragment([part, cols], kind) for kind, cols in (
                    (accum, K), (accum, C), (accum, C), (dtype, K), (dtype, C), (dtype, C))) for _ in range(cfg.chains)]
            elif cfg.chains:  # each chain group's S, X and Vnew of its columns
                parts = [tuple(T.alloc_fragment([rows, part], accum) for rows in (K, C, C)) + (None,) * 3
                         for _ in range(cfg.chains)]
            else:
                S_f = T.alloc_fragment([K, block_DV], accum)
                if delta:
                    KS_f = T.alloc_fragment([C, block_DV], accum)
                    Vn_f = T.alloc_fragment([C, block_DV], accum)
            if not cfg.folded:  # the output group's (folded: its scores alone)
                O_f = T.alloc_fragment([C, block_DV], accum)
            if not channel:  # folded: half of P's columns at a time (the scores group's registers)
                P_f = T.alloc_fragment([C, C // 2 if cfg.folded else C], accum)
            if cfg.two_output_groups:  # the even-chunk output group's own fragments
                O2_f = T.alloc_fragment([C, block_DV], accum)
                if not channel:
                    P2_f = T.alloc_fragment([C, C], accum)

            bb = T.alloc_var("int32")
            t_start = T.alloc_var("int32")
            t_end = T.alloc_var("int32")
            tile0 = None
            if channel:
                tile0 = T.alloc_var("int32")  # tile slot of the sequence's first chunk (D's row)
            if is_varlen:
                bb = 0
                t_start = cu_seqlens[bn]
                t_end = cu_seqlens[bn + 1]
                if channel:
                    tile0 = t_start // C + bn
            else:
                bb = bn
                t_start = 0
                t_end = Tn
                if channel:
                    tile0 = bn * T.ceildiv(Tn, C)
            t_out = h0_row = None
            if warmup and store_output:  # the segment's first row; the pass starts warm[0] chunks before it
                t_out = T.alloc_var("int32")
                h0_row = T.alloc_var("int32")
                t_out = t_start
                t_start = t_start - T.max(warm[0, bn, bh], 0) * C
                h0_row = warm[1, bn, bh]
            n_chunks = T.ceildiv(t_end - t_start, C)
            if warmup and not store_output:  # the table's row, and the transitions the warm-up leaves exact
                through = T.alloc_local([1], "int32")
                warmup_row(g, cu_seqlens, first, warm, bn, bh, max_chunks, initial, bv == 0, 4 * GROUP, through)
                n_chunks = T.if_then_else(through[0] > 0, n_chunks, 0)
            cta = SimpleNamespace(bb=bb, bn=bn, bh=bh, hq=hq, v0=v0, t_start=t_start, t_out=t_out, t_end=t_end,
                                  tile0=tile0, n_chunks=n_chunks, h0_row=h0_row, warm=warm)

            tx = T.get_thread_binding()
            if tx < GROUP:  # state, or the first chain group
                if cfg.chains:
                    T.set_max_nreg(FOLDED_CHAIN_REGS if cfg.folded else CHAIN_REGS if cfg.chains == 2
                                   else SOLE_CHAIN_REGS, 1)
                    chain_group(smem, cta, 0, *parts[0], h0, ht, h_init, o)
                else:
                    T.set_max_nreg(STATE_REGS, 1)
                    state_group(smem, cta, S_f, h0, ht, h_init)
            elif tx < 2 * GROUP:  # value, or the second chain group
                if cfg.chains == 2:
                    T.set_max_nreg(FOLDED_CHAIN_REGS if cfg.folded else CHAIN_REGS, 1)
                    chain_group(smem, cta, part, *parts[1], h0, ht, h_init, o)
                elif cfg.two_output_groups:
                    T.set_max_nreg(VALUE_REGS, 1)
                    output_group(0, P2_f, O2_f, smem, cta, o)
                elif cfg.value_writes_vd:
                    T.set_max_nreg(VALUE_REGS, 1)
                    value_group(smem, cta, KS_f, Vn_f)
                else:  # one chain group, or the plain update's state pass alone (K^T V from the input slots): idle
                    T.set_max_nreg(LOAD_REGS, 0)
            elif tx < 3 * GROUP:  # output
                if cfg.folded:  # the chain groups form and store the output; these warps its scores
                    T.set_max_nreg(SCORES_REGS, 0)
                    scores_group(smem, cta, P_f)
                elif store_output:
                    T.set_max_nreg(CHAIN_OUTPUT_REGS if cfg.chains == 2 else OUTPUT_REGS, 1)
                    output_group(1, P_f, O_f, smem, cta, o)
                else:  # the state pass alone: idle
                    T.set_max_nreg(LOAD_REGS, 0)
            else:  # load
                T.set_max_nreg(FOLDED_LOAD_REGS if cfg.folded else LOAD_REGS, 0)
                if tx < 3 * GROUP + 32:
                    tma_warp(smem, cta, q, k, v, A, kg, P)
                elif tx < 3 * GROUP + 64:
                    gate_warp(smem, cta, tx - (3 * GROUP + 32), g)
                elif cfg.vd_writers:  # the other two warps
                    vd_writers(smem, cta)

    return chunk_fwd_ws


def input_stages(K, block_DV, gate, delta, store_output):
    """Input slots (q, k, Kg, v, Ab, P, gc, exp(gc_last) per chunk): as many as shared memory holds beside the
    fixed buffers (S_s, Vd_s, Vnew_s, P_s, O_s), 2 to 4 (3 with the delta rule). Three let the loads of chunk c + 2
    overlap chunk c + 1 even when the output group lags a chunk behind; four keep more bytes in flight per SM."""
    return WsConfig.derive(K, block_DV, gate, delta, block_DV, store_output).stages


def direct_v(gate, delta):
    """Whether the state group adds K^T V straight from the input slots (the plain update without a scalar gate:
    Vd = V, the tail rows of both zeroed as they land) instead of a written Vd_s: plan.update_rule's "plain"."""
    return update_rule(gate, delta) == "plain"


def vd_slots(delta):
    """Vd_s slots: two under the plain update (the writer scales chunk c + 1's V while the state group adds chunk
    c's K^T Vd), one with the delta rule (shared memory; its Vd waits on the chain's Ab X anyway)."""
    return 1 if delta else 2
