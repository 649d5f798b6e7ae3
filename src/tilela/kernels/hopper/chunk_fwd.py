"""Chunk forward, state/output pass of the linear-attention ladder (C = 64, or 16): one CTA per (DV block, sequence,
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

Chunk 16 is the short-chunk path (seed 003: FlashKDA's chunk): kkt_solve's A from the 16x16 Neumann product, four
times the chain's steps at a quarter of the intra-chunk work each (plan.SHORT_CHUNK). Its 16-row products run on two
warps (plan.loop_tiles): a 16 x 16 product has no rows or columns for more.

Per-key-channel scores ("channel").  exp(gc_i - gc_j) cannot be split as exp(gc_i) exp(-gc_j) over a whole chunk:
exp(-gc_j) overflows once a channel has decayed by e^-88 within the chunk.  The chunk is cut into 16-row
sub-chunks (one at C = 16); query rows of sub-chunk a use the reference R_a = gc of the row just before it (R_0 = 0):

    Gamma_ij = [q_i exp(gc_i - R_a)] . [k_j exp(R_a - gc_j)]     for i in sub-chunk a, j <= i,

one C x C GEMM per sub-chunk (key rows j < 16 (a + 1)), keeping the rows of sub-chunk a (key rows past
16 (a + 1) are stale and only reach masked entries, j > i, which selects drop).  For j before
sub-chunk a both exponents are <= 0 (FLA's chunk_gla off-diagonal blocks); only the diagonal 16x16 block has a
positive exponent, R_a - gc_j = -(g summed over at most 16 tokens of sub-chunk a).  So the scores are exact as
long as no key channel decays by more than e^-80 within 16 tokens (log gate >= -5 per token on average, e.g.
KDA's lower bound -5; GLA's logsigmoid(x) / 16 for x >= -80).  The two score operands are bf16 for bf16 inputs
(the exponent range of fp32) and fp32 (tf32 GEMMs) for fp16 inputs, whose 65504 would cap the diagonal factor at
e^11.  Every other factor (Q ⊙ exp gc, the state decay exp(gc_last), K ⊙ exp(gc_last - gc)) has a non-positive
exponent for any gate and stays in the input dtype.

The state S stays in registers (fp32) for the whole sequence; only its low-precision copy goes through shared
memory to feed the tensor cores.  q/k/v/A tiles are whole C-row TMA tiles through a double-buffered pipeline
(TileLang specialises a producer warp group); rows past the tensor end come back as zeros.  A varlen tail tile
also holds rows of the next sequence: their k, v and A rows are zeroed in shared memory before any product reads
them (a mask by multiplication would carry a non-finite value of the next sequence across: 0 x NaN is NaN),
beta = 0 there, gc is clamped to the last valid row (every exponent stays as above), the causal mask keeps them
out of valid output rows, their Vnew rows are zeroed before the state update, and their output rows are not stored.
"""

import tilelang.language as T

from .common import SUB, channel_score_dtype, exp_e, sequence_of, state_pass_contract, subchunk_scores


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
    chunk=64,
):
    """Build the state/output pass for static head sizes, gate kind, update rule and tile sizes.

    Batch, sequence length, head counts and number of sequences are dynamic: one compiled kernel serves every
    T, every head configuration (GVA ratio G = HV / H) and every varlen layout.  Grid: (V // block_DV, HV,
    N sequences in the launch order).  Inputs absent for a configuration (g without a
    gate; beta and A for the plain update) are one-element placeholders. chunk: C, 64 or 16 (A [.., C] and gc
    chunk-local at C).
    """
    if chunk not in (16, 64):
        raise ValueError(f"chunk: expected 16 or 64, got {chunk}")
    C = chunk
    NV = V // block_DV
    accum = "float32"
    score_dtype = channel_score_dtype(dtype)
    sig = state_pass_contract(K, V, gate, delta, dtype, beta_dtype, chunk=C)
    B, Tn, H, HV, NS1 = sig.B, sig.Tn, sig.H, sig.HV, sig.NS1

    @T.macro
    def zero_tail_rows(buf, cols, t0, t_end):
        """In a sequence's last chunk, buf's rows of the following sequences set to 0 (read and written in place, so
        that the producer's load of buf is waited for first; placed before buf's first reader)."""
        if t0 + C > t_end:
            for i, j in T.Parallel(C, cols):
                buf[i, j] = T.if_then_else(t0 + i < t_end, buf[i, j], 0)

    @T.prim_func
    def chunk_fwd(q: sig.q, k: sig.k, v: sig.v, g: sig.g, beta: sig.beta, A: sig.A, h0: sig.h0,
                  cu_seqlens: sig.cu_seqlens, o: sig.o, ht: sig.ht, kg: sig.kg, P: sig.P, warm: sig.warm,
                  order: sig.order, h_init: sig.h_init, first: sig.first, max_chunks: sig.max_chunks,
                  initial: sig.initial):
        with T.Kernel(NV, HV, (NS1 - 1) if is_varlen else B, threads=threads) as (bv, bh, bz):
            bn = T.alloc_var("int32")
            bn = sequence_of(sig, order, bz) if is_varlen else bz
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
                Pa_f = T.alloc_fragment([C, C], accum) if C > SUB else None  # the later sub-chunks' scores

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
                zero_tail_rows(k_s, K, t0, t_end)
                if delta:
                    # residual R = beta * (V - (K ⊙ exp gc) S);  Vnew = A R
                    if gate == "channel":
                        for i, d in T.Parallel(C, K):
                            X_s[i, d] = k_s[i, d] * exp_e(g_s[i, d])
                        T.gemm(X_s, S_s, KS_f, clear_accum=True)
                    else:
                        T.gemm(k_s, S_s, KS_f, clear_accum=True)
                    zero_tail_rows(v_s, block_DV, t0, t_end)
                    for i, j in T.Parallel(C, block_DV):
                        if gate == "scalar":
                            R_s[i, j] = beta_s[i] * (v_s[i, j] - exp_e(g_s[i]) * KS_f[i, j])
                        else:
                            R_s[i, j] = beta_s[i] * (v_s[i, j] - KS_f[i, j])
                    zero_tail_rows(A_s, C, t0, t_end)
                    T.gemm(A_s, R_s, Vn_f, clear_accum=True)
                    T.copy(Vn_f, Vn_s)

                # O = scale * [(Q ⊙ exp gc) S + tril_incl(Gamma ⊙ Q K^T) Vnew]
                if gate == "channel":
                    for i, d in T.Parallel(C, K):
                        X_s[i, d] = q_s[i, d] * exp_e(g_s[i, d])
                    T.gemm(X_s, S_s, O_f, clear_accum=True)
                    # per-channel scores, sub-chunk a against the reference R_a (module docstring)
                    subchunk_scores(q_s, k_s, g_s, Qr_s, Kr_s, P_f, Pa_f, K, exp_e, C)
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
                if not delta:
                    zero_tail_rows(v_s, block_DV, t0, t_end)
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
