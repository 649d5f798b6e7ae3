"""GDN forward, state/output pass (chunk form, C = 64), one CTA per (DV block, sequence, value head).

Mirrors the reference stage "chunk state/output pass" of the float64 stack (document 004, §"等价数学变换";
002 §6.4.2 sequence-in-loop form).  Inputs are the chunk-local cumsum gc of the log gate and
A = (I + Akk)^-1 from kkt_solve.  For every chunk, with S the state entering it ([K, V] layout):

    R     = diag(beta) (V - diag(exp gc) K S)          (fused W/U:  A R = U - W S)
    Vnew  = A R
    O     = scale * [diag(exp gc) Q S + (tril_incl(Q K^T) * exp(gc_i - gc_j)) Vnew]
    S    <- exp(gc_last) S + K^T (diag(exp(gc_last - gc)) Vnew)

The chunk loop runs inside the CTA; S stays in registers (fp32) for the whole sequence and only its
low-precision copy goes through shared memory to feed the tensor cores.  Rows past the end of a
sequence are loaded as zeros (q, k, v, A, beta) with gc clamped to the last valid row, so every
exponent stays <= 0 and padded rows contribute nothing.
"""

import functools

import tilelang
import tilelang.language as T
import torch

CHUNK = 64
LOG2E = 1.4426950408889634

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def gdn_fwd_kernel(
    H,
    HV,
    K,
    V,
    scale,
    dtype="bfloat16",
    beta_dtype="float32",
    is_varlen=False,
    use_initial_state=False,
    store_final_state=False,
    block_DV=64,
    threads=256,
    num_stages=2,
):
    """Build the state/output pass for static head counts, head sizes and tile sizes.

    Batch, sequence length and number of sequences are dynamic: one compiled kernel serves every T and
    every varlen layout.  Grid: (V // block_DV, N sequences, HV).
    """
    C = CHUNK
    G = HV // H
    NV = V // block_DV
    accum = "float32"
    B, Tn, N0, N1, NS1 = T.dynamic("B, Tn, N0, N1, NS1")

    @T.prim_func
    def gdn_fwd(
        q: T.Tensor([B, Tn, H, K], dtype),
        k: T.Tensor([B, Tn, H, K], dtype),
        v: T.Tensor([B, Tn, HV, V], dtype),
        g: T.Tensor([B, Tn, HV], accum),
        beta: T.Tensor([B, Tn, HV], beta_dtype),
        A: T.Tensor([B, Tn, HV, C], dtype),
        h0: T.Tensor([N0, HV, K, V], accum),
        cu_seqlens: T.Tensor([NS1], "int32"),
        o: T.Tensor([B, Tn, HV, V], dtype),
        ht: T.Tensor([N1, HV, K, V], accum),
    ):
        with T.Kernel(NV, (NS1 - 1) if is_varlen else B, HV, threads=threads) as (bv, bn, bh):
            hq = bh // G
            v0 = bv * block_DV

            q_s = T.alloc_shared([C, K], dtype)
            k_s = T.alloc_shared([C, K], dtype)
            v_s = T.alloc_shared([C, block_DV], dtype)
            A_s = T.alloc_shared([C, C], dtype)
            g_s = T.alloc_shared([C], accum)
            beta_s = T.alloc_shared([C], accum)
            S_s = T.alloc_shared([K, block_DV], dtype)
            R_s = T.alloc_shared([C, block_DV], dtype)
            Vn_s = T.alloc_shared([C, block_DV], dtype)
            P_s = T.alloc_shared([C, C], dtype)
            o_s = T.alloc_shared([C, block_DV], dtype)

            S_f = T.alloc_fragment([K, block_DV], accum)
            KS_f = T.alloc_fragment([C, block_DV], accum)
            Vn_f = T.alloc_fragment([C, block_DV], accum)
            O_f = T.alloc_fragment([C, block_DV], accum)
            P_f = T.alloc_fragment([C, C], accum)

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
                for i, d in T.Parallel(C, K):
                    q_s[i, d] = T.if_then_else(t0 + i < t_end, q[bb, t0 + i, hq, d], 0)
                for i, d in T.Parallel(C, K):
                    k_s[i, d] = T.if_then_else(t0 + i < t_end, k[bb, t0 + i, hq, d], 0)
                for i, j in T.Parallel(C, block_DV):
                    v_s[i, j] = T.if_then_else(t0 + i < t_end, v[bb, t0 + i, bh, v0 + j], 0)
                for i, j in T.Parallel(C, C):
                    A_s[i, j] = T.if_then_else(t0 + i < t_end, A[bb, t0 + i, bh, j], 0)
                for i in T.Parallel(C):
                    g_s[i] = g[bb, T.min(t0 + i, t_end - 1), bh]
                    beta_s[i] = T.if_then_else(t0 + i < t_end, T.cast(beta[bb, t0 + i, bh], accum), 0)

                # R = beta * (V - exp(gc) * K S);  Vnew = A R
                T.copy(S_f, S_s)
                T.gemm(k_s, S_s, KS_f, clear_accum=True)
                for i, j in T.Parallel(C, block_DV):
                    R_s[i, j] = beta_s[i] * (v_s[i, j] - T.exp2(g_s[i] * LOG2E) * KS_f[i, j])
                T.gemm(A_s, R_s, Vn_f, clear_accum=True)
                T.copy(Vn_f, Vn_s)

                # O = scale * [exp(gc) Q S + (tril(Q K^T) * exp(gc_i - gc_j)) Vnew]
                T.gemm(q_s, S_s, O_f, clear_accum=True)
                T.gemm(q_s, k_s, P_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    P_f[i, j] = T.if_then_else(j <= i, P_f[i, j] * scale * T.exp2((g_s[i] - g_s[j]) * LOG2E), 0)
                T.copy(P_f, P_s)
                for i, j in T.Parallel(C, block_DV):
                    O_f[i, j] = O_f[i, j] * scale * T.exp2(g_s[i] * LOG2E)
                T.gemm(P_s, Vn_s, O_f)
                T.copy(O_f, o_s)
                for i, j in T.Parallel(C, block_DV):
                    if t0 + i < t_end:
                        o[bb, t0 + i, bh, v0 + j] = o_s[i, j]

                # S <- exp(gc_last) S + K^T diag(exp(gc_last - gc)) Vnew
                for i, j in T.Parallel(C, block_DV):
                    Vn_f[i, j] = Vn_f[i, j] * T.exp2((g_s[C - 1] - g_s[i]) * LOG2E)
                T.copy(Vn_f, Vn_s)
                for i, j in T.Parallel(K, block_DV):
                    S_f[i, j] = S_f[i, j] * T.exp2(g_s[C - 1] * LOG2E)
                T.gemm(k_s, Vn_s, S_f, transpose_A=True)

            if store_final_state:
                T.copy(S_f, ht[bn, bh, 0:K, v0 : v0 + block_DV])

    return gdn_fwd


def default_config(K, V):
    """Tile sizes per head size: (block_DV, threads, num_stages)."""
    if K >= 256:
        return 32, 256, 1
    if K >= 128:
        return 64, 256, 2
    return 64, 128, 2


@functools.lru_cache(maxsize=None)
def _compiled(H, HV, K, V, scale, dtype, beta_dtype, is_varlen, use_initial_state, store_final_state):
    block_DV, threads, num_stages = default_config(K, V)
    func = gdn_fwd_kernel(
        H,
        HV,
        K,
        V,
        scale,
        dtype=dtype,
        beta_dtype=beta_dtype,
        is_varlen=is_varlen,
        use_initial_state=use_initial_state,
        store_final_state=store_final_state,
        block_DV=block_DV,
        threads=threads,
        num_stages=num_stages,
    )
    return tilelang.compile(func, target="cuda", pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})


def gdn_forward(
    q, k, v, g_cumsum, beta, A, scale, initial_state=None, output_final_state=False, cu_seqlens=None
):
    """State/output pass of the GDN forward.  Returns (o [B,T,HV,V] in q's dtype, final state [N,HV,K,V] fp32 or None).

    g_cumsum: chunk-local cumsum of the log gate [B,T,HV] fp32; A: kkt_solve output [B,T,HV,64] in q's dtype.
    """
    B, Tn, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    kernel = _compiled(
        H,
        HV,
        K,
        V,
        float(scale),
        _DTYPES[q.dtype],
        _DTYPES[beta.dtype],
        cu_seqlens is not None,
        initial_state is not None,
        bool(output_final_state),
    )
    dev = q.device
    o = torch.empty_like(v)
    ht = torch.empty(N if output_final_state else 1, HV, K, V, dtype=torch.float32, device=dev)
    h0 = initial_state if initial_state is not None else ht
    cu = cu_seqlens.to(torch.int32) if cu_seqlens is not None else torch.zeros(2, dtype=torch.int32, device=dev)
    kernel(q, k, v, g_cumsum, beta, A, h0, cu, o, ht)
    return o, (ht if output_final_state else None)
