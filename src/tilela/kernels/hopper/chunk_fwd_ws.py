"""Chunk forward, state/output pass, warp-specialised (C = 64): one CTA of four warp groups per (DV block, sequence,
value head), the chunk loop inside every group (seed 004, "Hopper warp specialization"; seed 002 §6.4.2).

Computes the same per-chunk identity as chunk_fwd.py and mirrors the same reference stage
(reference.chunk_math.chunk_forward, looped by reference.seq_in_loop), for a scalar gate or none:

    Vnew = A diag(beta) (V - exp(gc) ⊙ (K S))         delta rule (A = kkt_solve output)
    Vnew = V                                           plain update
    O    = scale [exp(gc) ⊙ (Q S) + tril_incl(exp(gc_i - gc_j) ⊙ Q K^T) Vnew]
    S   <- exp(gc_last) S + K^T (exp(gc_last - gc) ⊙ Vnew)

and, for a per-key-channel gate with the plain update, from the factors gla_factors.py computes in parallel
beforehand (reference.chunk_math.gated_factors; they take the q, k, A and g slots):

    O    = scale Qg S + P V,       S <- D ⊙ S + Kd^T V,       D = exp(gc_last) per key channel

Levels served: linear_attn ("none", plain), simple_gla ("scalar", plain), gla ("channel", plain), delta_rule ("none",
delta), GDN ("scalar", delta); KDA (per-channel gate, delta rule) and K = 256 stay on chunk_fwd.py.

The four warp groups and what each owns (state on chip for the whole sequence, fp32 in the state group's registers):
    state   (threads   0-127)  S; writes its bf16 copy S_s, decays S, adds K^T Vd
    value   (threads 128-255)  K S -> R = beta (V - exp(gc) K S) (in place of the V tile) -> Vnew = A R ->
                               Vd_s = exp(gc_last - gc) Vnew (rows past the sequence end zeroed), then Vnew_s
                               (plain update: Vd_s = exp(gc_last - gc) V only)
    output  (threads 256-383)  P = Q K^T (before S is ready; loaded with a per-channel gate), Q S, O = ... + P Vnew,
                               stores O
    load    (threads 384-511)  one warp issues the TMA loads of q (for the output), k, v, A (or P); one warp (the
                               gate warp) loads gc, beta (or the chunk's D) GATE_AHEAD chunks ahead into registers
                               and writes them with the exp factors of gc; the other two warps idle
Plain update with output (levels 1-3): the value group has no products, so it becomes a second output group (even
chunks; the output group takes the odd ones: S_s slot c % 2 is read by the group of chunk c only, each group stages
its own P), and the two idle load warps write Vd_s = exp(gc_last - gc) V for the state group.
Plain update without a scalar gate (levels 1 and 3): Vd = V, so the state group adds K^T V straight from the input
slots (in the last chunk it first zeroes K's rows past the sequence end); no Vd_s, no Vd writers, and without a gate
no gate warp.
Every hand-over is a buffer with n slots (chunk c uses slot c % n) and one mbarrier pair per slot: "ready"
completes when the slot holds chunk c (wait parity (c // n) % 2), "free"/"read" when its readers are done with it
(the writer of chunk c waits parity (c // n + 1) % 2, which a fresh barrier passes: no wait for the first n chunks):
    loaded / consumed     load -> all      q, k, v, A, gc, beta (D)    n = input_stages: 2 to 4 (3 delta rule)
    S_ready / S_read      state -> value, output   S_s                  n = 2
    Vn_ready / Vn_read    value -> output  Vnew_s (delta rule)          n = 2, 1 at block_DV = 128 (shared memory)
    Vd_ready / Vd_read    value -> state   Vd_s                         n = 1 delta rule, 2 plain update with a
                                                                        scalar gate (two idle load warps write it)
The recurrence's critical path is S_s -> K S -> A R -> K^T Vd -> S_s. P = Q K^T, Q S, P Vnew and the store run
beside it in the output group, a chunk behind at most (two S_s slots: the state never waits for Q S of the
chunk it just left), and the next chunk's loads beside both.

Varlen tails as in chunk_fwd.py: the 64-row tiles of the last chunk hold the next sequence's rows (or TMA zeros past
the tensor end); beta = 0 there, gc is clamped to the last valid row, the causal mask keeps them out of valid rows,
Vd rows (or K rows, where the state reads V directly) are zeroed and output rows are not stored.
"""

import tilelang.language as T

from .common import TILE as CHUNK
from .common import exp_e, state_pass_contract

GROUP = 128  # threads of a warp group
GATES = ("none", "scalar", "channel")
# registers per thread after setmaxnreg, 160 + 152 + 144 + 56 = 512 (65536 over 512 threads, 128 at launch): the
# state group holds S (K x DV / 128 fp32); the load group's gate warp holds GATE_AHEAD chunks of gc / beta (at 48
# GDN's DV 64 and 128 spill); the compile test fails on any spill
STATE_REGS = 160
VALUE_REGS = 152
OUTPUT_REGS = 144
LOAD_REGS = 56
SHARED_BYTES = 226 * 1024  # of the 227 KiB a CTA may take, 1 KiB left for barriers and alignment
STATE_BARRIER = 1  # named barrier of the state group (bar.sync 0 is the CTA's)
GATE_AHEAD = 3  # chunks whose gate loads (gc, beta, D) the gate warp keeps in flight


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
):
    """Build the warp-specialised state/output pass for static head sizes (K in {64, 128}; V = K, or 2K for the
    sequence split's transitions), gate kind ("none" or "scalar"), update rule and DV block (dv_blocks(K)).  Batch,
    length, head counts and the varlen layout are dynamic.
    Grid: (V // block_DV, N sequences, HV), 512 threads.  Inputs absent for a configuration (g without a gate; beta
    and A for the plain update) are one-element placeholders.  store_output=False drops the output group (its
    warps idle, o is not written): the state pass alone, as the sequence split's transitions need it."""
    C = CHUNK
    NV = V // block_DV
    accum = "float32"
    scalar, channel = gate == "scalar", gate == "channel"
    if channel and delta:
        raise ValueError("gate: the per-channel gate takes the plain update here (KDA runs on chunk_fwd.py)")
    Vn_slots = 2 if block_DV <= 64 else 1
    Vd_slots = vd_slots(delta)
    # plain update with output: the value group has no products, so it takes the even chunks' output (the output
    # group the odd ones) and two idle load warps scale V into Vd
    pingpong = store_output and not delta
    # plain update without a scalar gate: Vd = V, so the state group adds K^T V from the input slots (the last
    # chunk's rows past the sequence end zeroed in K) and nobody writes Vd_s
    direct = direct_v(gate, delta)
    value_works = not pingpong and not direct  # the value group's products (delta rule) or Vd (state pass alone)
    # threads that read a chunk's input slots: the state group, the chunk's output group, the value group, and
    # under the plain update with output the two Vd-writing load warps
    consumer_threads = GROUP * (1 + int(store_output) + int(value_works)) + (64 if pingpong and not direct else 0)
    row_inputs = gate != "none" or delta  # the gate warp's loads (gc, D, beta, or the rows' end mask for Vd)
    S_readers = 1 if pingpong else int(delta) + int(store_output)  # warp groups that read S_s of a chunk
    Vn_shared = delta and store_output  # Vnew_s only feeds the output
    stages = input_stages(K, block_DV, gate, delta, store_output)
    sig = state_pass_contract(K, V, gate, delta, dtype, beta_dtype, scores=channel)
    B, Tn, H, HV, NS1 = sig.B, sig.Tn, sig.H, sig.HV, sig.NS1

    @T.macro
    def output_chunk(c, P_s, P_f, O_f, q_s, k_s, v_s, g_s, eg_s, A_s, S_s, Vn_s, loaded, consumed, S_ready, S_read,
                     Vn_ready, Vn_read, o, bb, bh, v0, t_start, t_end):
        """Chunk c's output by one warp group: P = Q K^T (before S is ready; loaded under the per-channel gate),
        O = scale (Q S) (exp(gc) rows) + P Vnew, stored; P_s its P staging, P_f and O_f its fragments."""
        s, slot = c % 2, c % stages
        t0 = t_start + c * C
        T.barrier_wait(loaded[slot], (c // stages) % 2)
        if not channel:
            T.gemm(q_s[slot, :, :], k_s[slot, :, :], P_f, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, C):
                if scalar:
                    P_f[i, j] = T.if_then_else(
                        j <= i, P_f[i, j] * scale * exp_e(g_s[slot, i] - g_s[slot, j]), 0
                    )
                else:
                    P_f[i, j] = T.if_then_else(j <= i, P_f[i, j] * scale, 0)
            T.copy(P_f, P_s)
            T.fence_proxy_async()
        T.barrier_wait(S_ready[s], (c // 2) % 2)
        T.gemm(q_s[slot, :, :], S_s[s, :, :], O_f, clear_accum=True)
        T.barrier_arrive(S_read[s])
        for i, j in T.Parallel(C, block_DV):
            if scalar:
                O_f[i, j] = O_f[i, j] * (scale * eg_s[slot, i])
            else:
                O_f[i, j] = O_f[i, j] * scale
        if delta:
            n = c % Vn_slots
            T.barrier_wait(Vn_ready[n], (c // Vn_slots) % 2)
            T.gemm(P_s, Vn_s[n, :, :], O_f)
            T.barrier_arrive(Vn_read[n])
        else:
            T.gemm(A_s[slot, :, :] if channel else P_s, v_s[slot, :, :], O_f)
        for i, j in T.Parallel(C, block_DV):
            if t0 + i < t_end:
                o[bb, t0 + i, bh, v0 + j] = O_f[i, j]
        T.barrier_arrive(consumed[slot])

    @T.macro
    def fetch_gate_rows(u, c, g_r, beta_r, g_last, d_r, g, beta, lane, bb, bh, t_start, t_end, tile0, n_chunks):
        """The gate warp's loads of chunk c (clamped to the last chunk: the loads past it are harmless repeats)
        into register set u: gc and beta of rows lane and lane + 32 (clamped to the sequence's last row), gc_last,
        or the chunk's D under the per-channel gate. They stay in flight until the chunk's slot is written."""
        t0 = t_start + T.min(c, n_chunks - 1) * C
        for r in T.unroll(C // 32):
            if scalar:
                g_r[u, r] = g[bb, T.min(t0 + lane + 32 * r, t_end - 1), bh]
            if delta:
                beta_r[u, r] = T.cast(beta[bb, T.min(t0 + lane + 32 * r, t_end - 1), bh], accum)
        if scalar:
            g_last[u] = g[bb, T.min(t0 + C - 1, t_end - 1), bh]
        if channel:
            for e in T.unroll(K // 32):
                d_r[u, e] = g[tile0 + T.min(c, n_chunks - 1), bh, lane + 32 * e]

    @T.prim_func
    def chunk_fwd_ws(q: sig.q, k: sig.k, v: sig.v, g: sig.g, beta: sig.beta, A: sig.A, h0: sig.h0,
                     cu_seqlens: sig.cu_seqlens, o: sig.o, ht: sig.ht):
        with T.Kernel(NV, (NS1 - 1) if is_varlen else B, HV, threads=4 * GROUP) as (bv, bn, bh):
            hq = bh // (HV // H)
            v0 = bv * block_DV

            q_s = T.alloc_shared([stages, C, K], dtype)
            k_s = T.alloc_shared([stages, C, K], dtype)
            v_s = T.alloc_shared([stages, C, block_DV], dtype)  # V, overwritten by R in the delta rule
            g_s = eg_s = ed_s = None
            if scalar:
                g_s = T.alloc_shared([stages, C], accum)  # gc
                eg_s = T.alloc_shared([stages, C], accum)  # exp(gc)
            if not direct:
                ed_s = T.alloc_shared([stages, C], accum)  # exp(gc_last - gc), 0 past the sequence end
            A_s = None
            if delta or (channel and store_output):
                A_s = T.alloc_shared([stages, C, C], dtype)  # A (delta rule) or P (per-channel gate)
            if delta:
                beta_s = T.alloc_shared([stages, C], accum)
            if channel:
                d_s = T.alloc_shared([stages, K], accum)  # D = exp(gc_last) per key channel
            Vn_s = Vn_ready = Vn_read = P_s = P_f = None
            if Vn_shared:
                Vn_s = T.alloc_shared([Vn_slots, C, block_DV], dtype)
            S_s = T.alloc_shared([2, K, block_DV], dtype)
            if not direct:
                Vd_s = T.alloc_shared([Vd_slots, C, block_DV], dtype)
            if not channel:
                P_s = T.alloc_shared([2, C, C] if pingpong else [C, C], dtype)

            S_f = T.alloc_fragment([K, block_DV], accum)
            if delta:
                KS_f = T.alloc_fragment([C, block_DV], accum)
            if delta:
                Vn_f = T.alloc_fragment([C, block_DV], accum)
            O_f = T.alloc_fragment([C, block_DV], accum)
            if not channel:
                P_f = T.alloc_fragment([C, C], accum)
            if pingpong:  # the even-chunk output group's own fragments
                O2_f = T.alloc_fragment([C, block_DV], accum)
                P2_f = None if channel else T.alloc_fragment([C, C], accum)

            loaded = T.alloc_barrier([64 if row_inputs else 32] * stages)  # the TMA warp (and the gate warp)
            consumed = T.alloc_barrier([consumer_threads] * stages)
            if S_readers:
                S_ready = T.alloc_barrier([GROUP, GROUP])
                S_read = T.alloc_barrier([S_readers * GROUP] * 2)
            if not direct:
                Vd_ready = T.alloc_barrier([64 if pingpong else GROUP] * Vd_slots)
                Vd_read = T.alloc_barrier([GROUP] * Vd_slots)
            if Vn_shared:
                Vn_ready = T.alloc_barrier([GROUP] * Vn_slots)
                Vn_read = T.alloc_barrier([GROUP] * Vn_slots)

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
            n_chunks = T.ceildiv(t_end - t_start, C)

            tx = T.get_thread_binding()
            if tx < GROUP:  # state
                T.set_max_nreg(STATE_REGS, 1)
                decay = T.alloc_local([1], accum)
                if use_initial_state:
                    T.copy(h0[bn, bh, 0:K, v0 : v0 + block_DV], S_f)
                else:
                    T.clear(S_f)
                for c in T.serial(n_chunks):
                    s, slot = c % 2, c % stages
                    T.barrier_wait(loaded[slot], (c // stages) % 2)
                    if S_readers:
                        T.barrier_wait(S_read[s], (c // 2 + 1) % 2)
                        T.copy(S_f, S_s[s, :, :])
                        T.fence_proxy_async()
                        T.barrier_arrive(S_ready[s])
                    if scalar:
                        decay[0] = eg_s[slot, C - 1]
                        for i, j in T.Parallel(K, block_DV):
                            S_f[i, j] = S_f[i, j] * decay[0]
                    if channel:
                        for i, j in T.Parallel(K, block_DV):
                            S_f[i, j] = S_f[i, j] * d_s[slot, i]
                    if direct:
                        t0 = t_start + c * C
                        if t0 + C > t_end:  # the last chunk's rows past the end: K zeroed, so their V adds nothing
                            for i, j in T.Parallel(C, K):
                                if t0 + i >= t_end:
                                    k_s[slot, i, j] = 0
                            T.fence_proxy_async()
                            T.sync_threads(STATE_BARRIER, GROUP)
                        T.gemm(k_s[slot, :, :], v_s[slot, :, :], S_f, transpose_A=True)
                    else:
                        T.barrier_wait(Vd_ready[c % Vd_slots], (c // Vd_slots) % 2)
                        T.gemm(k_s[slot, :, :], Vd_s[c % Vd_slots, :, :], S_f, transpose_A=True)
                        T.barrier_arrive(Vd_read[c % Vd_slots])
                    T.barrier_arrive(consumed[slot])
                if store_final_state:
                    T.copy(S_f, ht[bn, bh, 0:K, v0 : v0 + block_DV])

            elif tx < 2 * GROUP:  # value (the plain update with output: the even chunks' output)
                if pingpong or value_works:
                    T.set_max_nreg(VALUE_REGS, 1)
                else:  # the plain update's state pass alone without Vd: this group idles
                    T.set_max_nreg(LOAD_REGS, 0)
                if pingpong:
                    for cc in T.serial(T.ceildiv(n_chunks, 2)):
                        output_chunk(2 * cc, None if channel else P_s[0, :, :], P2_f, O2_f, q_s, k_s, v_s, g_s, eg_s,
                                     A_s, S_s, Vn_s, loaded, consumed, S_ready, S_read, Vn_ready, Vn_read, o, bb, bh,
                                     v0, t_start, t_end)
                elif value_works:
                    for c in T.serial(n_chunks):
                        s, slot = c % 2, c % stages
                        T.barrier_wait(loaded[slot], (c // stages) % 2)
                        if delta:
                            T.barrier_wait(S_ready[s], (c // 2) % 2)
                            T.gemm(k_s[slot, :, :], S_s[s, :, :], KS_f, clear_accum=True)
                            T.barrier_arrive(S_read[s])
                            for i, j in T.Parallel(C, block_DV):
                                if scalar:
                                    KS_f[i, j] = beta_s[slot, i] * (v_s[slot, i, j] - eg_s[slot, i] * KS_f[i, j])
                                else:
                                    KS_f[i, j] = beta_s[slot, i] * (v_s[slot, i, j] - KS_f[i, j])
                            T.copy(KS_f, v_s[slot, :, :])
                            T.fence_proxy_async()
                            T.gemm(A_s[slot, :, :], v_s[slot, :, :], Vn_f, clear_accum=True)
                        # Vd first: it is on the recurrence's critical path, Vnew_s for the output group is not
                        T.barrier_wait(Vd_read[c % Vd_slots], (c // Vd_slots + 1) % 2)
                        for i, j in T.Parallel(C, block_DV):
                            Vd_s[c % Vd_slots, i, j] = ed_s[slot, i] * (Vn_f[i, j] if delta else v_s[slot, i, j])
                        T.fence_proxy_async()
                        T.barrier_arrive(Vd_ready[c % Vd_slots])
                        if Vn_shared:
                            n = c % Vn_slots
                            T.barrier_wait(Vn_read[n], (c // Vn_slots + 1) % 2)
                            T.copy(Vn_f, Vn_s[n, :, :])
                            T.fence_proxy_async()
                            T.barrier_arrive(Vn_ready[n])
                        T.barrier_arrive(consumed[slot])

            elif tx < 3 * GROUP:  # output
                if store_output:
                    T.set_max_nreg(OUTPUT_REGS, 1)
                    if pingpong:
                        for cc in T.serial(T.ceildiv(n_chunks - 1, 2)):
                            output_chunk(2 * cc + 1, None if channel else P_s[1, :, :], P_f, O_f, q_s, k_s, v_s,
                                         g_s, eg_s, A_s, S_s, Vn_s, loaded, consumed, S_ready, S_read, Vn_ready,
                                         Vn_read, o, bb, bh, v0, t_start, t_end)
                    else:
                        for c in T.serial(n_chunks):
                            output_chunk(c, P_s, P_f, O_f, q_s, k_s, v_s, g_s, eg_s, A_s, S_s, Vn_s, loaded,
                                         consumed, S_ready, S_read, Vn_ready, Vn_read, o, bb, bh, v0, t_start, t_end)
                else:  # the state pass alone: this group idles
                    T.set_max_nreg(LOAD_REGS, 0)

            else:  # load
                T.set_max_nreg(LOAD_REGS, 0)
                if tx < 3 * GROUP + 32:
                    for c in T.serial(n_chunks):
                        slot = c % stages
                        t0 = t_start + c * C
                        T.barrier_wait(consumed[slot], (c // stages + 1) % 2)
                        if store_output:
                            T.tma_copy(q[bb, t0 : t0 + C, hq, :], q_s[slot, :, :], barrier=loaded[slot])
                        T.tma_copy(k[bb, t0 : t0 + C, hq, :], k_s[slot, :, :], barrier=loaded[slot])
                        T.tma_copy(v[bb, t0 : t0 + C, bh, v0 : v0 + block_DV], v_s[slot, :, :], barrier=loaded[slot])
                        if delta or (channel and store_output):
                            T.tma_copy(A[bb, t0 : t0 + C, bh, :], A_s[slot, :, :], barrier=loaded[slot])
                        T.barrier_arrive(loaded[slot])
                elif tx < 3 * GROUP + 64 and row_inputs:  # one warp, rows lane and lane + 32 of each chunk
                    lane = tx - (3 * GROUP + 32)
                    # registers of the GATE_AHEAD chunks whose loads are in flight (chunk c in set c % GATE_AHEAD)
                    g_r = T.alloc_local([GATE_AHEAD, C // 32], accum)
                    beta_r = T.alloc_local([GATE_AHEAD, C // 32], accum)
                    g_last = T.alloc_local([GATE_AHEAD], accum)
                    d_r = T.alloc_local([GATE_AHEAD, K // 32], accum)
                    for u in T.unroll(GATE_AHEAD):
                        if u < n_chunks:
                            fetch_gate_rows(u, u, g_r, beta_r, g_last, d_r, g, beta, lane, bb, bh, t_start, t_end,
                                            tile0, n_chunks)
                    for cc in T.serial(T.ceildiv(n_chunks, GATE_AHEAD)):
                        for u in T.unroll(GATE_AHEAD):
                            c = cc * GATE_AHEAD + u
                            if c < n_chunks:
                                slot = c % stages
                                t0 = t_start + c * C
                                T.barrier_wait(consumed[slot], (c // stages + 1) % 2)
                                for r in T.unroll(C // 32):
                                    i = lane + 32 * r
                                    if scalar:
                                        g_s[slot, i] = g_r[u, r]
                                        eg_s[slot, i] = exp_e(g_r[u, r])
                                        ed_s[slot, i] = T.if_then_else(t0 + i < t_end, exp_e(g_last[u] - g_r[u, r]), 0)
                                    elif not direct:
                                        ed_s[slot, i] = T.if_then_else(t0 + i < t_end, 1, 0)
                                    if delta:
                                        beta_s[slot, i] = T.if_then_else(t0 + i < t_end, beta_r[u, r], 0)
                                if channel:
                                    for e in T.unroll(K // 32):
                                        d_s[slot, lane + 32 * e] = d_r[u, e]
                                T.barrier_arrive(loaded[slot])
                                fetch_gate_rows(u, c + GATE_AHEAD, g_r, beta_r, g_last, d_r, g, beta, lane, bb, bh,
                                                t_start, t_end, tile0, n_chunks)
                elif pingpong and not direct:  # Vd = exp(gc_last - gc) V (rows past the end zeroed) for the state group
                    for c in T.serial(n_chunks):
                        slot = c % stages
                        T.barrier_wait(loaded[slot], (c // stages) % 2)
                        T.barrier_wait(Vd_read[c % Vd_slots], (c // Vd_slots + 1) % 2)
                        for i, j in T.Parallel(C, block_DV):
                            Vd_s[c % Vd_slots, i, j] = ed_s[slot, i] * v_s[slot, i, j]
                        T.fence_proxy_async()
                        T.barrier_arrive(Vd_ready[c % Vd_slots])
                        T.barrier_arrive(consumed[slot])

    return chunk_fwd_ws


def input_stages(K, block_DV, gate, delta, store_output):
    """Input slots (q, k, v, A or P, gc, beta, exp(gc_last) per chunk): as many as shared memory holds beside the
    fixed buffers (S_s, Vd_s, Vnew_s, P_s), 2 to 4 (3 with the delta rule, whose chunk periods were measured there).
    Three let the loads of chunk c + 2 overlap chunk c + 1 even when the output group lags a chunk behind; four
    keep more bytes in flight per SM."""
    direct = direct_v(gate, delta)
    per_stage = 2 * CHUNK * (K * (1 + int(store_output)) + block_DV)  # q, k, v
    per_stage += 4 * CHUNK * (2 * int(gate == "scalar") + int(not direct) + int(delta))  # gc, exp(gc); ed; beta
    if delta or (gate == "channel" and store_output):
        per_stage += 2 * CHUNK * CHUNK  # A or P
    if gate == "channel":
        per_stage += 4 * K  # D
    fixed = 2 * 2 * K * block_DV * int(delta or store_output)  # S_s
    fixed += 0 if direct else 2 * vd_slots(delta) * CHUNK * block_DV  # Vd_s
    fixed += 2 * CHUNK * block_DV * (2 if block_DV <= 64 else 1) * int(delta and store_output)  # Vnew_s
    fixed += 2 * CHUNK * CHUNK * (0 if gate == "channel" or not store_output else 1 if delta else 2)  # P_s
    return max(2, min(3 if delta else 4, (SHARED_BYTES - fixed) // per_stage))


def direct_v(gate, delta):
    """Whether the state group adds K^T V straight from the input slots (the plain update without a scalar gate:
    Vd = V but for the rows past a sequence end, which go through K) instead of a written Vd_s."""
    return not delta and gate != "scalar"


def vd_slots(delta):
    """Vd_s slots: two under the plain update (the writer scales chunk c + 1's V while the state group adds chunk
    c's K^T Vd), one with the delta rule (shared memory; its Vd waits on the chain's A R anyway)."""
    return 1 if delta else 2
