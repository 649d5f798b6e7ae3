"""Chunk forward, state/output pass of the linear-attention ladder (C = 64): one CTA per (DV block, sequence,
value head), the chunk loop inside the CTA (seed 002 §6.4.2, sequence in the loop).

Mirrors reference layer D (reference.seq_in_loop), whose per-chunk step is reference.chunk_math.chunk_forward.
For every chunk, with S the state entering it ([K, V] layout) and gc the chunk-local cumsum of the log gate:

    Vnew = A diag(beta) (V - (K ⊙ exp gc) S)         delta rule (A = kkt_solve output: Vnew = U - W S)
    Vnew = V                                          plain update
    O    = scale [(Q ⊙ exp gc) S + tril_incl(Gamma ⊙ Q K^T) Vnew]
           (Gamma ⊙ Q K^T)_ij = sum_d q_id k_jd exp(gc_id - gc_jd)
    S   <- exp(gc_last) ⊙ S + (K ⊙ exp(gc_last - gc))^T Vnew

One builder serves the ladder through two static choices, gate and delta:
    level 1 linear_attn  ("none", plain)     level 2 simple_gla ("scalar", plain)     level 3 gla ("channel", plain)
    level 4 delta_rule   ("none", delta)     GDN ("scalar", delta)                     KDA ("channel", delta)
gate "none" drops every exp factor (gc = 0) and the g input; the plain update drops A, beta and the Vnew pass.

Per-key-channel scores ("channel").  exp(gc_i - gc_j) cannot be split as exp(gc_i) exp(-gc_j) over a whole chunk:
exp(-gc_j) overflows once a channel has decayed by e^-88 within the chunk.  The chunk is cut into four 16-row
sub-chunks; query rows of sub-chunk a use the reference R_a = gc of the row just before it (R_0 = 0):

    Gamma_ij = [q_i exp(gc_i - R_a)] . [k_j exp(R_a - gc_j)]     for i in sub-chunk a, j <= i,

one 64x64 GEMM per sub-chunk (key rows j < 16 (a + 1)), keeping the rows of sub-chunk a (key rows past
16 (a + 1) are stale and only reach masked entries, j > i, which selects drop).  For j before
sub-chunk a both exponents are <= 0 (FLA's chunk_gla off-diagonal blocks); only the diagonal 16x16 block has a
positive exponent, R_a - gc_j = -(g summed over at most 16 tokens of sub-chunk a).  So the scores are exact as
long as no key channel decays by more than e^-80 within 16 tokens (log gate >= -5 per token on average, e.g.
KDA's lower bound -5; GLA's logsigmoid(x) / 16 for x >= -80).  The two score operands are bf16 for bf16 inputs
(the exponent range of fp32) and fp32 (tf32 GEMMs) for fp16 inputs, whose 65504 would cap the diagonal factor at
e^11.  Every other factor (Q ⊙ exp gc, the state decay exp(gc_last), K ⊙ exp(gc_last - gc)) has a non-positive
exponent for any gate and stays in the input dtype.

The state S stays in registers (fp32) for the whole sequence; only its low-precision copy goes through shared
memory to feed the tensor cores.  q/k/v/A tiles are whole 64-row TMA tiles through a double-buffered pipeline
(TileLang specialises a producer warp group); rows past the tensor end come back as zeros.  A varlen tail tile
also holds rows of the next sequence: they are neutralised instead of reloaded: beta = 0 there (so the delta
residual is 0), gc is clamped to the last valid row (every exponent stays as above), the causal mask keeps them
out of valid output rows, their Vnew rows are zeroed before the state update, and their output rows are not stored.
"""

import tilelang.language as T
import torch

from .. import TILE as CHUNK
from .. import channel_score_dtype, exp_e, state_pass_contract, subchunk_scores
from . import DTYPES, _placeholder, chunk_fwd_ws, compiled, gla_factors, multiprocessors, seq_split

GATES = ("none", "scalar", "channel")


def chunk_fwd_kernel(
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
    block_DV=32,
    threads=128,
    num_stages=2,
):
    """Build the state/output pass for static head sizes, gate kind, update rule and tile sizes.

    Batch, sequence length, head counts and number of sequences are dynamic: one compiled kernel serves every
    T, every head configuration (GVA ratio G = HV / H) and every varlen layout.  Grid: (V // block_DV,
    N sequences, HV).  Inputs absent for a configuration (g without a
    gate; beta and A for the plain update) are one-element placeholders.
    """
    C = CHUNK
    NV = V // block_DV
    accum = "float32"
    score_dtype = channel_score_dtype(dtype)
    sig = state_pass_contract(K, V, gate, delta, dtype, beta_dtype)
    B, Tn, H, HV, NS1 = sig.B, sig.Tn, sig.H, sig.HV, sig.NS1

    @T.prim_func
    def chunk_fwd(q: sig.q, k: sig.k, v: sig.v, g: sig.g, beta: sig.beta, A: sig.A, h0: sig.h0,
                  cu_seqlens: sig.cu_seqlens, o: sig.o, ht: sig.ht):
        with T.Kernel(NV, (NS1 - 1) if is_varlen else B, HV, threads=threads) as (bv, bn, bh):
            hq = bh // (HV // H)
            v0 = bv * block_DV

            q_s = T.alloc_shared([C, K], dtype)
            k_s = T.alloc_shared([C, K], dtype)
            v_s = T.alloc_shared([C, block_DV], dtype)
            if delta:
                A_s = T.alloc_shared([C, C], dtype)
            if gate == "scalar":
                g_s = T.alloc_shared([C], accum)
            if gate == "channel":
                g_s = T.alloc_shared([C, K], accum)
                X_s = T.alloc_shared([C, K], dtype)  # K ⊙ exp gc (delta rule), Q ⊙ exp gc, K ⊙ exp(gc_last - gc)
                Qr_s = T.alloc_shared([C, K], score_dtype)  # q_i exp(gc_i - R_a)
                Kr_s = T.alloc_shared([C, K], score_dtype)  # k_j exp(R_a - gc_j)
            if delta:
                beta_s = T.alloc_shared([C], accum)
            S_s = T.alloc_shared([K, block_DV], dtype)
            if delta:
                R_s = T.alloc_shared([C, block_DV], dtype)
            Vn_s = T.alloc_shared([C, block_DV], dtype)
            P_s = T.alloc_shared([C, C], dtype)
            o_s = T.alloc_shared([C, block_DV], dtype)

            S_f = T.alloc_fragment([K, block_DV], accum)
            if delta:
                KS_f = T.alloc_fragment([C, block_DV], accum)
                Vn_f = T.alloc_fragment([C, block_DV], accum)
            O_f = T.alloc_fragment([C, block_DV], accum)
            P_f = T.alloc_fragment([C, C], accum)
            if gate == "channel":
                Pa_f = T.alloc_fragment([C, C], accum)

            bb = T.alloc_var("int32")
            t_start = T.alloc_var("int32")
            t_end = T.alloc_var("int32")
            if is_varlen:
                bb = 0
                t_start = cu_seqlens[bn]
                t_end = cu_seqlens[bn + 1]
            else:
                bb = bn
                t_start = 0
                t_end = Tn

            if use_initial_state:
                T.copy(h0[bn, bh, 0:K, v0 : v0 + block_DV], S_f)
            else:
                T.clear(S_f)

            for c in T.Pipelined(T.ceildiv(t_end - t_start, C), num_stages=num_stages):
                t0 = t_start + c * C
                T.copy(q[bb, t0 : t0 + C, hq, :], q_s)
                T.copy(k[bb, t0 : t0 + C, hq, :], k_s)
                T.copy(v[bb, t0 : t0 + C, bh, v0 : v0 + block_DV], v_s)
                if delta:
                    T.copy(A[bb, t0 : t0 + C, bh, :], A_s)
                if gate == "scalar" or delta:
                    for i in T.Parallel(C):
                        if gate == "scalar":
                            g_s[i] = g[bb, T.min(t0 + i, t_end - 1), bh]
                        if delta:
                            beta_s[i] = T.if_then_else(t0 + i < t_end, T.cast(beta[bb, t0 + i, bh], accum), 0)
                if gate == "channel":
                    for i, d in T.Parallel(C, K):
                        g_s[i, d] = g[bb, T.min(t0 + i, t_end - 1), bh, d]

                T.copy(S_f, S_s)
                if delta:
                    # residual R = beta * (V - (K ⊙ exp gc) S);  Vnew = A R
                    if gate == "channel":
                        for i, d in T.Parallel(C, K):
                            X_s[i, d] = k_s[i, d] * exp_e(g_s[i, d])
                        T.gemm(X_s, S_s, KS_f, clear_accum=True)
                    else:
                        T.gemm(k_s, S_s, KS_f, clear_accum=True)
                    for i, j in T.Parallel(C, block_DV):
                        if gate == "scalar":
                            R_s[i, j] = beta_s[i] * (v_s[i, j] - exp_e(g_s[i]) * KS_f[i, j])
                        else:
                            R_s[i, j] = beta_s[i] * (v_s[i, j] - KS_f[i, j])
                    T.gemm(A_s, R_s, Vn_f, clear_accum=True)
                    T.copy(Vn_f, Vn_s)

                # O = scale * [(Q ⊙ exp gc) S + tril_incl(Gamma ⊙ Q K^T) Vnew]
                if gate == "channel":
                    for i, d in T.Parallel(C, K):
                        X_s[i, d] = q_s[i, d] * exp_e(g_s[i, d])
                    T.gemm(X_s, S_s, O_f, clear_accum=True)
                    # per-channel scores, sub-chunk a against the reference R_a (module docstring)
                    subchunk_scores(q_s, k_s, g_s, Qr_s, Kr_s, P_f, Pa_f, K, exp_e)
                else:
                    T.gemm(q_s, S_s, O_f, clear_accum=True)
                    T.gemm(q_s, k_s, P_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    if gate == "scalar":
                        P_f[i, j] = T.if_then_else(j <= i, P_f[i, j] * scale * exp_e(g_s[i] - g_s[j]), 0)
                    else:
                        P_f[i, j] = T.if_then_else(j <= i, P_f[i, j] * scale, 0)
                T.copy(P_f, P_s)
                for i, j in T.Parallel(C, block_DV):
                    if gate == "scalar":
                        O_f[i, j] = O_f[i, j] * scale * exp_e(g_s[i])
                    else:
                        O_f[i, j] = O_f[i, j] * scale
                T.gemm(P_s, Vn_s if delta else v_s, O_f)
                T.copy(O_f, o_s)
                for i, j in T.Parallel(C, block_DV):
                    if t0 + i < t_end:
                        o[bb, t0 + i, bh, v0 + j] = o_s[i, j]

                # S <- exp(gc_last) ⊙ S + (K ⊙ exp(gc_last - gc))^T Vnew   (rows past the sequence end dropped)
                if delta:
                    for i, j in T.Parallel(C, block_DV):
                        if gate == "scalar":
                            Vn_f[i, j] = T.if_then_else(
                                t0 + i < t_end, Vn_f[i, j] * exp_e(g_s[C - 1] - g_s[i]), 0
                            )
                        else:
                            Vn_f[i, j] = T.if_then_else(t0 + i < t_end, Vn_f[i, j], 0)
                    T.copy(Vn_f, Vn_s)
                else:
                    for i, j in T.Parallel(C, block_DV):
                        if gate == "scalar":
                            Vn_s[i, j] = T.if_then_else(t0 + i < t_end, v_s[i, j] * exp_e(g_s[C - 1] - g_s[i]), 0)
                        else:
                            Vn_s[i, j] = T.if_then_else(t0 + i < t_end, v_s[i, j], 0)
                if gate == "scalar":
                    for i, j in T.Parallel(K, block_DV):
                        S_f[i, j] = S_f[i, j] * exp_e(g_s[C - 1])
                    T.gemm(k_s, Vn_s, S_f, transpose_A=True)
                elif gate == "channel":
                    for i, d in T.Parallel(C, K):
                        X_s[i, d] = k_s[i, d] * exp_e(g_s[C - 1, d] - g_s[i, d])
                    for d, j in T.Parallel(K, block_DV):
                        S_f[d, j] = S_f[d, j] * exp_e(g_s[C - 1, d])
                    T.gemm(X_s, Vn_s, S_f, transpose_A=True)
                else:
                    T.gemm(k_s, Vn_s, S_f, transpose_A=True)

            if store_final_state:
                T.copy(S_f, ht[bn, bh, 0:K, v0 : v0 + block_DV])

    return chunk_fwd


def default_config(K, gate="scalar", delta=True, dtype="bfloat16"):
    """Tile sizes (block_DV, threads, num_stages).  32-wide DV blocks give 4 CTAs per value head at V = 128 (the
    grid fills the H200 at 32 heads).  One stage where double buffers would pass the 227 KiB of shared memory:
    q/k at K = 256; with the per-channel gate at K = 128, its fp32 gc tile plus the delta-rule tiles or the fp32
    score operands of fp16 inputs."""
    single = K >= 256 or (gate == "channel" and K >= 128 and (delta or dtype == "float16"))
    return 32, 128, 1 if single else 2


def launch_buffers(v, K, initial_state, output_final_state, cu_seqlens):
    """(o, ht, h0, cu) of a state/output launch: o like v; the final-state buffer [N,HV,K,V] fp32 (one row when not
    stored); the initial-state argument (ht stands in when absent); cu_seqlens as int32 (a dummy when dense)."""
    B, HV, V = v.shape[0], v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dev = v.device
    o = torch.empty_like(v)
    ht = torch.empty(N if output_final_state else 1, HV, K, V, dtype=torch.float32, device=dev)
    h0 = initial_state if initial_state is not None else ht
    cu = cu_seqlens.to(torch.int32) if cu_seqlens is not None else _placeholder(dev, torch.int32)
    return o, ht, h0, cu


def _launch(kernel, q, k, v, g_cumsum, beta, A, initial_state, output_final_state, cu_seqlens):
    """Run a compiled state/output pass; (o, final state or None)."""
    o, ht, h0, cu = launch_buffers(v, q.shape[3], initial_state, output_final_state, cu_seqlens)
    placeholder = _placeholder(q.device, torch.float32)
    kernel(
        q,
        k,
        v,
        placeholder if g_cumsum is None else g_cumsum,
        placeholder if beta is None else beta,  # beta belongs to the delta rule, A to it and the per-channel factors
        _placeholder(q.device, q.dtype) if A is None else A,
        h0,
        cu,
        o,
        ht,
    )
    return o, (ht if output_final_state else None)


def _static(q, v, g_cumsum, beta, A, scale, initial_state, output_final_state, cu_seqlens):
    """The static configuration of a call: (K, V, scale, gate, delta rule, dtype, beta dtype, varlen, initial
    state, final state)."""
    gate = "none" if g_cumsum is None else GATES[g_cumsum.dim() - 2]
    delta = A is not None
    return (q.shape[3], v.shape[3], float(scale), gate, delta, DTYPES[q.dtype],
            DTYPES[beta.dtype] if delta else "float32", cu_seqlens is not None, initial_state is not None,
            bool(output_final_state))


def _ws_state_pass(q, k, v, g_cumsum, beta, A, scale, h0, cu_seqlens, store_output, store_final_state):
    """The warp-specialised pass in the sequence split's contract (varlen, initial state in)."""
    static = _static(q, v, g_cumsum, beta, A, scale, h0, store_final_state, cu_seqlens)
    K, V, _, gate, delta = static[:5]
    block_DV = chunk_fwd_ws.default_block_DV(K, V, (cu_seqlens.shape[0] - 1) * v.shape[2], multiprocessors(v.device),
                                             store_output, chunk_fwd_ws.update_rule(gate, delta))
    kernel = compiled(chunk_fwd_ws.chunk_fwd_ws_kernel, *static, block_DV, store_output, warp_specialized=True)
    return _launch(kernel, q, k, v, g_cumsum, beta, A, h0, store_final_state, cu_seqlens)


def chunk_forward(
    q, k, v, g_cumsum, beta, A, scale, initial_state=None, output_final_state=False, cu_seqlens=None, *,
    kernel="auto", segments=None, block_DV=None, g_is_cumsum=True,
):
    """State/output pass of every ladder level.  Returns (o [B,T,HV,V] in q's dtype, final state [N,HV,K,V] fp32
    or None).

    g_cumsum: chunk-local cumsum of the log gate in fp32, [B,T,HV] (scalar gate), [B,T,HV,K] (per-key-channel
    gate) or None (no gate).  beta [B,T,HV] and A [B,T,HV,64] (kkt_solve output, q's dtype) for the delta rule;
    both None for the plain update S += k v^T.
    kernel: "ws" the warp-specialised pass (chunk_fwd_ws.py: K = V in {64, 128}, scalar gate or none, or a
    per-channel gate with the plain update, whose factors gla_factors.py computes first), "loop" this file's
    single-warp-group pass (every configuration), "auto" the first that covers the call.
    segments: a seq_split.SegmentPlan of the call's sequence lengths to run the segments of each sequence in
    parallel (the warp-specialised pass only; seq_split.py), or None.
    block_DV: the warp-specialised pass's DV block, one of chunk_fwd_ws.dv_blocks(K) (None:
    chunk_fwd_ws.default_block_DV).
    g_is_cumsum=False: g_cumsum is the raw per-channel log gate, summed inside gla_factors (so gc never goes through
    global memory); only the warp-specialised pass under a per-channel gate takes it.
    """
    static = _static(q, v, g_cumsum, beta, A, scale, initial_state, output_final_state, cu_seqlens)
    K, V, _, gate, delta, dtype = static[:6]
    if kernel not in ("auto", "ws", "loop"):
        raise ValueError(f"kernel: expected 'auto', 'ws' or 'loop', got {kernel!r}")
    ws = chunk_fwd_ws.covers(K, V, gate, delta, dtype)
    if (kernel == "ws" or segments is not None) and not ws:
        raise ValueError(f"kernel='ws' covers K = V in (64, 128) with a scalar gate or none, or a per-channel gate "
                         f"with the plain update, got K={K}, V={V}, gate {gate!r}, delta rule {delta}, {dtype}")
    if not g_is_cumsum and (gate != "channel" or not ws or kernel == "loop"):
        raise ValueError(f"g_is_cumsum=False: only the warp-specialised pass under a per-channel gate sums the raw "
                         f"gate itself, got gate {gate!r} (covered: {ws}, kernel={kernel!r})")
    if segments is not None and gate not in seq_split.GATES:
        raise ValueError("segments: the sequence split takes no per-channel gate (its transitions would be "
                         "diagonal per key channel, not scalar), got a [B, T, HV, K] gate")
    if block_DV is not None and (block_DV not in chunk_fwd_ws.dv_blocks(K) or not ws or kernel == "loop"
                                 or segments is not None):
        raise ValueError(f"block_DV: the unsplit warp-specialised pass takes one of {chunk_fwd_ws.dv_blocks(K)}, got "
                         f"{block_DV} (kernel={kernel!r}, covered: {ws}, split: {segments is not None})")
    if segments is not None:
        if kernel == "loop":
            raise ValueError("segments: the sequence split runs on the warp-specialised pass, got kernel='loop'")
        return seq_split.split_forward(_ws_state_pass, seq_split.entering_states, q, k, v, g_cumsum, beta, A, scale,
                                       initial_state, output_final_state, segments)
    if ws and kernel != "loop":
        N = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        block_DV = block_DV or chunk_fwd_ws.default_block_DV(K, V, N * v.shape[2], multiprocessors(v.device),
                                                             rule=chunk_fwd_ws.update_rule(gate, delta))
        compiled_kernel = compiled(chunk_fwd_ws.chunk_fwd_ws_kernel, *static, block_DV, True, warp_specialized=True)
        if gate == "channel":  # the state-independent factors first, in the q, k, A and g slots (chunk_fwd_ws.py)
            q, k, A, g_cumsum = gla_factors(q, k, g_cumsum, scale, cu_seqlens, cumsum=not g_is_cumsum)
    else:
        compiled_kernel = compiled(chunk_fwd_kernel, *static, *default_config(K, gate, delta, dtype),
                                   warp_specialized=True)
    return _launch(compiled_kernel, q, k, v, g_cumsum, beta, A, initial_state, output_final_state, cu_seqlens)
