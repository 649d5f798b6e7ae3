"""The PyTorch path: chunked, vectorised forward of every op, on any device.

One chunk step covers the whole ladder (seed 002 §1, seed 004 §"理论推导"). With gc the
chunk-local cumsum of the log gate g (scalar per token or per key channel, none = 0),
Gamma_ij = exp(gc_i - gc_j) (i >= j, exponent never positive) and S0 the state entering the chunk:

    delta rule:  A    = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1      (UT transform)
                 U    = A diag(beta) V,   W = A diag(beta) (K ⊙ exp(gc))       (WY form)
                 Vnew = U - W S0
    plain:       Vnew = V
    output:      O      = scale (Q ⊙ exp(gc)) S0 + P Vnew,   P = scale tril(Gamma ⊙ Q K^T)
    state:       S_next = exp(gc_last) S0 + (K ⊙ exp(gc_last - gc))^T Vnew

The log gate is floored at ``tilela._gates.LOG_GATE_FLOOR`` before the cumsum (exact where exp underflows).
Everything but the last three lines is independent of S0, so it runs once over all chunks of all sequences
(``ChunkLayout``: chunks gathered from the token axis, no sequence padded to the longest); only the state
recurrence walks the chunks in order, one step per chunk index, batched over the sequences that still have a full
chunk at that index. A sequence's last, partial chunk is padded to the next power of two only and runs after its
full chunks, batched with the other sequences' partial chunks of that padded length. Time and memory so grow with
the number of tokens (plus at most one padded chunk per sequence), whatever the layout.

A padded token has k = v = beta = g = 0 and so leaves the state untouched. Arithmetic runs in float32 (float64 for
float64 inputs). The chunk identities are ``tilela.reference.chunk_math``'s, run in the compute dtype; this is
what runs where no Hopper GPU is present. Every index is built on the host from the sequence bounds, with no
data-dependent shape, so no value is read back from the device (meta and fake tensors flow through).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._gates import floor_log_gate
from .._validation import Dims, non_finite
from ..reference.chunk_math import gated_factors, ut_transform, wy_form

CHUNK = 64
CHANNEL_CHUNK = 16  # a per-channel gate's scores take C x C x K work per chunk: smaller chunks, same result
SLAB_ELEMENTS = 1 << 24  # bound on the per-channel decay tensor [chunks, HV, C, C, K] built at once


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ChunkGroup:
    """Chunks of one padded length P: ``index`` [n, P] holds each slot's flat token (B * T for a pad: the zero
    row), ``hold`` the same with a pad holding its chunk's last real token, ``seqs`` [n] the sequence rank of each
    chunk (in ``ChunkLayout.order``)."""

    index: torch.Tensor
    hold: torch.Tensor
    seqs: torch.Tensor


@dataclass(frozen=True)
class ChunkLayout:
    """The chunks of every sequence of a call, gathered from the flat token axis [B * T].

    ``order`` ranks the sequences by descending count of full chunks (stable). ``groups[0]`` holds the full
    chunks step-major: the chunks of index c of ranks 0 .. steps[c] - 1 follow one another, so step c reads a
    contiguous slice and the state rows of a prefix of the ranks. ``groups[1:]`` hold the partial last chunks, one
    group per padded length. ``slot`` [B * T] is each token's position in the concatenated slots of all groups.
    """

    order: torch.Tensor
    steps: tuple[int, ...]
    groups: tuple[ChunkGroup, ...]
    slot: torch.Tensor

    @classmethod
    def of(cls, dims: Dims, chunk_size: int, device: torch.device) -> "ChunkLayout":
        C, pad = chunk_size, dims.B * dims.T
        bos = [b for b, _ in dims.seq_bounds]
        length = [e - b for b, e in dims.seq_bounds]
        order = sorted(range(dims.N), key=lambda n: -(length[n] // C))
        steps = tuple(sum(1 for n in order if length[n] // C > c) for c in range(max(length, default=0) // C))
        full = [(bos[n] + c * C, C, r) for c, count in enumerate(steps) for r, n in enumerate(order[:count])]
        tails: dict[int, list] = {}
        for r, n in enumerate(order):
            if length[n] % C:
                tail = length[n] % C
                tails.setdefault(1 << (tail - 1).bit_length(), []).append((bos[n] + length[n] - tail, tail, r))
        groups, slot, filled = [], torch.empty(pad + 1, dtype=torch.int64), 0  # slot[pad]: where the pads write
        for P, chunks in [(C, full), *sorted(tails.items())]:
            if not chunks:
                continue
            first, count, ranks = (torch.tensor(col, dtype=torch.int64) for col in zip(*chunks))
            pos = torch.arange(P, dtype=torch.int64)
            real = pos < count[:, None]
            tokens = first[:, None] + pos
            index = torch.where(real, tokens, pad)
            slot[index.flatten()] = filled + torch.arange(len(chunks) * P)
            filled += len(chunks) * P
            hold = torch.where(real, tokens, (first + count - 1)[:, None])
            groups.append(ChunkGroup(index.to(device), hold.to(device), ranks.to(device)))
        return cls(torch.tensor(order, dtype=torch.int64).to(device), steps, tuple(groups), slot[:pad].to(device))

    def gather(self, x: torch.Tensor, dtype: torch.dtype, hold: bool = False) -> list[torch.Tensor]:
        """x [B, T, ...] -> per group [n, P, ...] in dtype; a pad is 0 (hold=True: its chunk's last value)."""
        flat = x.reshape(-1, *x.shape[2:]).to(dtype)
        if not hold:
            flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return [flat[(grp.hold if hold else grp.index)] for grp in self.groups]

    def heads(self, x: torch.Tensor, dtype: torch.dtype, G: int = 1) -> list[torch.Tensor]:
        """``gather`` (pads 0), head-major: per group [n, H * G, P, ...] (value head h reads head h // G)."""
        return [head_major(part, G) for part in self.gather(x, dtype)]

    def scatter(self, parts: list[torch.Tensor], dims: Dims, trailing: tuple[int, ...]) -> torch.Tensor:
        """Per group [n, P, *trailing] -> [B, T, *trailing]: each token's slot (pads dropped)."""
        if not parts:  # no token at all
            return torch.empty(dims.B, dims.T, *trailing, device=self.slot.device)
        flat = torch.cat([p.flatten(0, 1) for p in parts])
        return flat.index_select(0, self.slot).reshape(dims.B, dims.T, *trailing)


def head_major(x: torch.Tensor, G: int = 1) -> torch.Tensor:
    """[n, P, H, ...] -> [n, H * G, P, ...] (value head h reads head h // G)."""
    return x.repeat_interleave(G, dim=2).transpose(1, 2) if G > 1 else x.transpose(1, 2)


def token_major(x: torch.Tensor) -> torch.Tensor:
    """[n, HV, P, ...] -> [n, P, HV, ...]."""
    return x.transpose(1, 2)


def gate_groups(lay: ChunkLayout, g: torch.Tensor | None, like: list[torch.Tensor], dtype: torch.dtype,
                raw: bool) -> list[torch.Tensor]:
    """The chunk-local cumsum gc per group as [n, HV, P, Kg] (Kg = 1 for a scalar gate; zeros, shaped as ``like``'s
    groups, without a gate). raw: g is the log gate, floored and summed here; else g is already gc, and a pad holds
    its chunk's last value (so no Gamma of a pad row exceeds 1)."""
    if g is None:
        return [x.new_zeros(*x.shape[:-1], 1) for x in like]
    parts = [head_major(x if x.dim() == 4 else x[..., None]) for x in lay.gather(g, dtype, hold=not raw)]
    return [floor_log_gate(x).cumsum(dim=2) for x in parts] if raw else parts


def slabs(n: int, per_chunk: int) -> list[slice]:
    """Slices of n chunks that each build at most SLAB_ELEMENTS elements (at least one chunk)."""
    step = max(1, SLAB_ELEMENTS // max(per_chunk, 1))
    return [slice(i, i + step) for i in range(0, n, step)]


def chunk_factors(q, k, v, gc, beta, scale):
    """The state-independent factors of chunks [n, HV, P, ...]: (W, U, Qg, Kd, P, decay) with
    Vnew = U - W S0 (W None without the delta rule), O = Qg S0 + P Vnew, S_next = decay ⊙ S0 + Kd^T Vnew."""
    per_chunk = q.shape[1] * q.shape[2] ** 2 * gc.shape[-1]
    parts = []
    for sl in slabs(q.shape[0], per_chunk):
        W, U = (None, v[sl]) if beta is None else wy_form(k[sl], v[sl], beta[sl], gc[sl])
        Qg, Kd, P = gated_factors(q[sl], k[sl], gc[sl], scale)
        parts.append((W, U, Qg * scale, Kd, P, gc[sl, :, -1, :].exp()[..., None]))
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))


def state_step(S, W, U, Qg, Kd, P, decay):
    """One chunk of the recurrence over a batch of chunks: (O, S_next)."""
    Vnew = U if W is None else U - W @ S
    return Qg @ S + P @ Vnew, decay * S + Kd.transpose(-1, -2) @ Vnew


def cleaned(name: str, x: torch.Tensor | None, G: int = 1) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(x with its non-finite entries (``_validation.non_finite``) set to 0, [B, T, HV] mask of the tokens that
    held one, q/k heads repeated G times), or (None, None)."""
    if x is None:
        return None, None
    bad = non_finite(name, x)
    token_bad = (bad if x.dim() == 3 else bad.any(-1)).repeat_interleave(G, dim=2)
    return torch.where(bad, torch.zeros((), dtype=x.dtype, device=x.device), x), token_bad


def reached(bad: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, torch.Tensor]:
    """For bad [B, T, HV]: ([B, T, HV] whether a bad token precedes or is each token in its sequence, [N, HV]
    whether sequence n holds one)."""
    device = bad.device
    nonempty = [(n, b, e) for n, (b, e) in enumerate(dims.seq_bounds) if e > b]
    start = torch.repeat_interleave(torch.tensor([b for _, b, _ in nonempty], dtype=torch.int64),
                                    torch.tensor([e - b for _, b, e in nonempty], dtype=torch.int64),
                                    output_size=dims.B * dims.T).to(device)
    flat = bad.reshape(dims.B * dims.T, dims.HV).to(torch.int32)
    count = flat.cumsum(0, dtype=torch.int32)
    reach = count > (count - flat).index_select(0, start)
    rows, last = (torch.tensor(col, dtype=torch.int64).to(device) for col in
                  ([n for n, _, _ in nonempty], [e - 1 for _, _, e in nonempty]))
    held = torch.zeros(dims.N, dims.HV, dtype=torch.bool, device=device).index_copy(0, rows,
                                                                                    reach.index_select(0, last))
    return reach.reshape(bad.shape), held


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    dims: Dims,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked forward of the general gated (delta) rule; inputs validated by the caller.

    Non-finite inputs are set to 0 for the arithmetic and their reach marked NaN afterwards, as the recurrence
    carries them: a bad q_t makes o_t NaN; a bad k_t, v_t, beta_t or g_t (NaN, ±inf; g = -inf is a reset) every
    o_t' with t' >= t of its sequence and value heads, and their final state. So nothing spreads backwards in time,
    as the chunk form's products with the causal mask's zeros would make it."""
    cdt = compute_dtype(q)
    C = CHANNEL_CHUNK if g is not None and g.dim() == 4 else CHUNK
    lay = ChunkLayout.of(dims, C, q.device)
    G = dims.HV // dims.H
    (q, q_bad), (k, k_bad), (v, v_bad) = cleaned("q", q, G), cleaned("k", k, G), cleaned("v", v)
    (g, g_bad), (beta, beta_bad) = cleaned("g", g), cleaned("beta", beta)
    enters_state = k_bad | v_bad
    for mask in (g_bad, beta_bad):
        if mask is not None:
            enters_state = enters_state | mask
    state_bad, final_bad = reached(enters_state, dims)
    qs, ks, vs = lay.heads(q, cdt, G), lay.heads(k, cdt, G), lay.heads(v, cdt)
    gcs = gate_groups(lay, g, ks, cdt, raw=True)
    betas = [None] * len(qs) if beta is None else lay.heads(beta, cdt)

    if initial_state is None:
        S = q.new_zeros(dims.N, dims.HV, dims.K, dims.V, dtype=cdt)
    else:
        S = initial_state.to(cdt).index_select(0, lay.order)
    outputs = []
    for i, parts in enumerate(zip(qs, ks, vs, gcs, betas)):
        factors = chunk_factors(*parts, scale)
        o = torch.empty_like(parts[2])
        if i == 0 and lay.steps:  # the full chunks, step by step; no in-place write to S, which autograd saves
            start, done = 0, []
            for count in lay.steps:  # non-increasing: sequences in order of decreasing length
                sl = slice(start, start + count)
                done.append(S[count:])  # the states of the sequences whose full chunks ended
                o[sl], S = state_step(S[:count], *(None if f is None else f[sl] for f in factors))
                start += count
            S = torch.cat([S, *reversed(done)])
        else:  # partial last chunks, all at once
            ranks = lay.groups[i].seqs
            o, S_last = state_step(S.index_select(0, ranks), *factors)
            S = S.index_copy(0, ranks, S_last)
        outputs.append(token_major(o))
    nan = torch.full((), float("nan"), dtype=v.dtype, device=v.device)
    out = torch.where((q_bad | state_bad)[..., None], nan, lay.scatter(outputs, dims, (dims.HV, dims.V)).to(v.dtype))
    if not output_final_state:
        return out, None
    S = torch.empty_like(S).index_copy(0, lay.order, S)
    return out, torch.where(final_bad[..., None, None], nan.to(S.dtype), S)


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int, scale: float | None, dims: Dims) -> torch.Tensor:
    """Per-chunk inclusive prefix sum of the floored g [B, T, H] or [B, T, H, K], restarting at every sequence."""
    lay = ChunkLayout.of(dims, chunk_size, g.device)
    parts = [floor_log_gate(x).cumsum(dim=1) for x in lay.gather(g, compute_dtype(g))]
    out = lay.scatter(parts, dims, tuple(g.shape[2:])).to(compute_dtype(g))
    return out if scale is None else out * scale


def kkt_solve(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None, chunk_size: int, dims: Dims) -> torch.Tensor:
    """Per chunk A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1, laid out [B, T, HV, C].

    g is the chunk-local cumsum of the log gate (as ``chunk_local_cumsum`` returns), or None. Row t holds row i
    (t's index inside its chunk); columns past the chunk's end are 0.
    """
    C = chunk_size
    cdt = compute_dtype(k)
    lay = ChunkLayout.of(dims, C, k.device)
    G = dims.HV // dims.H
    ks = lay.heads(k, cdt, G)
    parts = []
    for kc, bc, gc in zip(ks, lay.heads(beta, cdt), gate_groups(lay, g, ks, cdt, raw=False)):
        A = ut_transform(kc, bc, gc)  # [n, HV, P, P]
        parts.append(token_major(torch.nn.functional.pad(A, (0, C - A.shape[-1]))))
    return lay.scatter(parts, dims, (dims.HV, C)).to(k.dtype)
