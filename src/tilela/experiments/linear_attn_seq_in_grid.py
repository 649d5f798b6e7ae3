"""Linear attention (ladder level 1) with the sequence in the grid (seed 002 §4): one CTA per (chunk x DV block,
sequence, value head), each CTA recomputing the state entering its chunk from its sequence's start:

    S_c = S0 + sum_{c' < c} K_{c'}^T V_{c'}                  (c prefix GEMMs: NC (NC - 1) / 2 in all, §6.3)
    O_c = scale [Q_c S_c + tril_incl(Q_c K_c^T) V_c]
    S_final = S_{NC-1} + K_{NC-1}^T V_{NC-1}                   (stored by the CTA of the sequence's last chunk)

Mirrors reference layer C (reference.seq_in_grid) with no gate and the plain update.  A reference kernel kept to
measure what the sequence axis in the grid costs (O(N^2) in the sequence length); the production form of the same
level is chunk_fwd with gate "none" and the plain update (sequence loop inside the CTA, §6.4.2).

Grid x holds ceil(T / 64) chunk slots per sequence (T, the packed token count, bounds every sequence, so the host
needs no sequence lengths); CTAs past their sequence's end exit at once, except chunk 0 of an empty sequence, which
stores S0 as its final state.  A varlen tail tile also holds rows of the next sequence: the causal mask keeps
them out of valid output rows, they are zeroed in V before the final state update, and their outputs are not stored.
"""

import tilelang.language as T

import torch

from ..kernels.hopper import DTYPE_NAMES
from ..kernels.hopper.launch import compiled, placeholder
from ..kernels.hopper.plan import CHUNK


def linear_attn_seq_in_grid_kernel(
    H,
    HV,
    K,
    V,
    scale,
    dtype="bfloat16",
    is_varlen=False,
    use_initial_state=False,
    store_final_state=False,
    block_DV=32,
    threads=128,
    num_stages=2,
):
    """Build the sequence-in-grid kernel for static head counts, head sizes and tile sizes (B, T, N dynamic).
    Grid: (ceil(T / 64) * V // block_DV, N sequences, HV)."""
    C = CHUNK
    G = HV // H
    NV = V // block_DV
    accum = "float32"
    B, Tn, N0, N1, NS1 = T.dynamic("B, Tn, N0, N1, NS1")

    @T.prim_func
    def linear_attn_seq_in_grid(
        q: T.Tensor([B, Tn, H, K], dtype),
        k: T.Tensor([B, Tn, H, K], dtype),
        v: T.Tensor([B, Tn, HV, V], dtype),
        h0: T.Tensor([N0, HV, K, V], accum),
        cu_seqlens: T.Tensor([NS1], "int32"),
        o: T.Tensor([B, Tn, HV, V], dtype),
        ht: T.Tensor([N1, HV, K, V], accum),
    ):
        with T.Kernel(
            T.max(T.ceildiv(Tn, C), 1) * NV, (NS1 - 1) if is_varlen else B, HV, threads=threads
        ) as (bx, bn, bh):
            bc = bx // NV
            v0 = (bx % NV) * block_DV
            hq = bh // G

            kp_s = T.alloc_shared([C, K], dtype)
            vp_s = T.alloc_shared([C, block_DV], dtype)
            q_s = T.alloc_shared([C, K], dtype)
            k_s = T.alloc_shared([C, K], dtype)
            v_s = T.alloc_shared([C, block_DV], dtype)
            S_s = T.alloc_shared([K, block_DV], dtype)
            P_s = T.alloc_shared([C, C], dtype)
            o_s = T.alloc_shared([C, block_DV], dtype)

            S_f = T.alloc_fragment([K, block_DV], accum)
            O_f = T.alloc_fragment([C, block_DV], accum)
            P_f = T.alloc_fragment([C, C], accum)

            bb = 0 if is_varlen else bn
            t_start = cu_seqlens[bn] if is_varlen else 0
            t_end = cu_seqlens[bn + 1] if is_varlen else Tn
            t0 = t_start + bc * C

            if bc == 0 or t0 < t_end:
                if use_initial_state:
                    T.copy(h0[bn, bh, 0:K, v0 : v0 + block_DV], S_f)
                else:
                    T.clear(S_f)
                # S_c = S0 + sum_{c' < c} K_c'^T V_c'   (recomputed by every CTA)
                for c in T.Pipelined(bc, num_stages=num_stages):
                    T.copy(k[bb, t_start + c * C : t_start + (c + 1) * C, hq, :], kp_s)
                    T.copy(v[bb, t_start + c * C : t_start + (c + 1) * C, bh, v0 : v0 + block_DV], vp_s)
                    T.gemm(kp_s, vp_s, S_f, transpose_A=True)
                T.copy(S_f, S_s)

                # O_c = scale [Q_c S_c + tril_incl(Q_c K_c^T) V_c]
                T.copy(q[bb, t0 : t0 + C, hq, :], q_s)
                T.copy(k[bb, t0 : t0 + C, hq, :], k_s)
                T.copy(v[bb, t0 : t0 + C, bh, v0 : v0 + block_DV], v_s)
                T.gemm(q_s, S_s, O_f, clear_accum=True)
                T.gemm(q_s, k_s, P_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    P_f[i, j] = T.if_then_else(j <= i, P_f[i, j] * scale, 0)
                T.copy(P_f, P_s)
                for i, j in T.Parallel(C, block_DV):
                    O_f[i, j] = O_f[i, j] * scale
                T.gemm(P_s, v_s, O_f)
                T.copy(O_f, o_s)
                for i, j in T.Parallel(C, block_DV):
                    if t0 + i < t_end:
                        o[bb, t0 + i, bh, v0 + j] = o_s[i, j]

                if store_final_state:
                    if t0 + C >= t_end:
                        for i, j in T.Parallel(C, block_DV):
                            v_s[i, j] = T.if_then_else(t0 + i < t_end, v_s[i, j], 0)
                        T.gemm(k_s, v_s, S_f, transpose_A=True)
                        T.copy(S_f, ht[bn, bh, 0:K, v0 : v0 + block_DV])

    return linear_attn_seq_in_grid


def linear_attn_seq_in_grid(q, k, v, scale, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Level-1 forward, sequence in the grid.  Returns (o [B,T,HV,V] in q's dtype, final state [N,HV,K,V] fp32
    or None)."""
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    kernel = compiled(
        linear_attn_seq_in_grid_kernel,
        H,
        HV,
        K,
        V,
        float(scale),
        DTYPE_NAMES[q.dtype],
        cu_seqlens is not None,
        initial_state is not None,
        bool(output_final_state),
        warp_specialized=True,
    )
    N = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = torch.empty_like(v)
    ht = torch.empty(N if output_final_state else 1, HV, K, V, dtype=torch.float32, device=v.device)
    cu = placeholder(v.device, torch.int32) if cu_seqlens is None else cu_seqlens.to(torch.int32)
    kernel(q, k, v, ht if initial_state is None else initial_state, cu, o, ht)
    return o, (ht if output_final_state else None)
