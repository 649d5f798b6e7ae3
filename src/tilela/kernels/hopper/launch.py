"""Execution of a Hopper plan: the compiled-kernel cache, the one int32 conversion and tile schedule per call, and
every launcher. Nothing here decides: each launcher takes its stage's key from the Plan (plan.py) and passes it to
the builder unchanged; inputs were validated once by tilela.ops.

The pipeline (`forward`), as named stages over the [B, T, H, D] layout:
    gc = chunk-local cumsum of g                  launch_cumsum      plan.cumsum   (cumsum.py; none where the
                                                                                   per-channel stages sum g)
    A  = kkt_solve(k, beta, gc)                   launch_kkt         plan.kkt      (kkt_solve.py; delta rule; with
                                                                                   a scalar gate it sums gc itself,
                                                                                   in place of the cumsum stage)
    Qg, Kd, Kg, P, Ab, D = gla_factors(q, k, beta, gc)                plan.factors  (gla_factors.py; per-channel gate
                                                  launch_factors                   on the ws pass: they take the q, k,
                                                                                   kg, P and g slots; with the delta
                                                                                   rule Ab = A diag(beta) the A slot,
                                                                                   no kkt_solve)
    o, S = state pass(q, k, v, gc, beta, A, S0)   launch_state_pass  plan.passes   (chunk_fwd_ws.py or chunk_fwd.py;
                                                                                   split: seq_split.py's transform,
                                                                                   launch_combine for its step 2;
                                                                                   GDN's transitions form its
                                                                                   warm-up table, warmup.py)
With plan.pipeline, gla_factors and the state pass run range by range over the call's one sequence, a range's pass
beside the next range's factors (seq_pipeline.py's transform, _pipelined).

Before it, use_qk_l2norm_in_kernel normalises q and k (tilela.ops, plan.l2norm_covers): launch_l2norm (l2norm.py).

Nothing synchronises with the host: the varlen tile schedule is found on the device (common.locate_tile) from host
sizes (T, N). Compiled kernels are cached per static configuration (the plan's keys); token counts, head counts and
varlen layouts are symbolic, so a new length, head count or layout never recompiles.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import DTYPE_NAMES, seq_pipeline, seq_split
from .chunk_fwd import chunk_fwd_kernel
from .chunk_fwd_ws import chunk_fwd_ws_kernel
from .common import TILE, pass_configs, search_rounds, target
from .cumsum import chunk_local_cumsum_kernel
from .gla_factors import gla_factors_kernel
from .host_tables import device_table
from .kkt_solve import kkt_solve_kernel
from .l2norm import l2norm_kernel
from .plan import Plan
from .seq_combine import seq_combine_kernel
from .seq_split import flat, segment_table

STATE_PASSES = {"ws": chunk_fwd_ws_kernel, "loop": chunk_fwd_kernel}
# builders whose kernels guard every global access themselves (rows against the sequence end, tile slots against the
# grid): compiled without TileLang's per-access bounds tests (common.pass_configs)
GUARDED = frozenset({gla_factors_kernel, kkt_solve_kernel, chunk_fwd_ws_kernel})


@functools.lru_cache(maxsize=None)
def compiled(builder, *static, warp_specialized: bool = False):
    """The launch function of builder(*static)'s kernel, compiled for sm_90a once per process (and cached on disk by
    TileLang): launch_function of its JIT kernel."""
    return launch_function(jit_kernel(builder, *static, warp_specialized=warp_specialized))


def jit_kernel(builder, *static, warp_specialized: bool = False):
    """TileLang's JIT kernel of builder(*static) for sm_90a.

    warp_specialized: let TileLang give a TMA pipeline a producer warp group (the state passes); the latency-bound
    kkt_solve, cumsum, gla_factors and combine kernels want several small CTAs per SM instead (common.PASS_CONFIGS)."""
    import tilelang

    configs = pass_configs(warp_specialized, builder in GUARDED)
    return tilelang.compile(builder(*static), target=target(), pass_configs=configs, execution_backend="tvm_ffi")


def launch_function(kernel):
    """The main function of a JIT kernel's compiled module, which converts and checks its arguments itself: what the
    kernel's own call reaches after TileLang's Python (our launchers pass every argument, outputs included, so that
    Python has nothing to add). A kernel compiled in this process
    holds a TVM Executable (the module after jit()), one loaded from TileLang's disk cache the loaded module; a
    kernel without either keeps its own call."""
    import tvm_ffi

    get_executable = getattr(kernel.adapter, "_get_executable", None)
    if get_executable is None:
        return kernel
    executable = get_executable()
    module = executable if isinstance(executable, tvm_ffi.Module) else executable.jit()
    return module.main


@functools.lru_cache(maxsize=None)
def placeholder(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...] = (1,)) -> torch.Tensor:
    """A small tensor standing in for an absent optional input (cu_seqlens of a dense batch, no gate, the log gate's
    in-kernel gate parameters)."""
    return torch.zeros(shape, device=device, dtype=dtype)


def gate_args(device: torch.device, params: tuple | None, scale: float | None) -> tuple:
    """(A_log, dt_bias, scale) as the stages that form the log gate take them: FLA's in-kernel gate's A_log and
    dt_bias (params, of tilela._gates.param_shapes; one placeholder for both under the log gate) flat
    in float32 (views where they are float32 already: no kernel), and the factor on the sum (the sigmoid form's lower
    bound; 1 otherwise)."""
    scale = 1.0 if scale is None else float(scale)
    if params is None:
        absent = placeholder(device, torch.float32)
        return absent, absent, scale
    A_log, dt_bias = (x.to(torch.float32).reshape(-1).contiguous() for x in params)
    return A_log, dt_bias, scale


class Schedule(NamedTuple):
    """A call's token layout for the kernels, computed once: cu_seqlens as int32 (a placeholder when dense), the
    tile-parallel kernels' grid (num_slots tile slots; dense_len = T for the dense layout, else 0; search_steps
    rounds of the varlen search: common.locate_tile) and the sequence count N."""

    cu: torch.Tensor
    num_slots: int
    dense_len: int
    search_steps: int
    N: int

    @classmethod
    def of(cls, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> "Schedule":
        B, Tn = x.shape[:2]
        if cu_seqlens is None:
            return cls(placeholder(x.device, torch.int32), B * -(-Tn // TILE), Tn, 0, B)
        N = cu_seqlens.numel() - 1
        return cls(cu_seqlens.to(torch.int32).contiguous(), Tn // TILE + N, 0, search_rounds(N), N)

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.num_slots, self.dense_len, self.search_steps


# ---- stages ------------------------------------------------------------------------------------------------------
def launch_cumsum(key: tuple, g: torch.Tensor, sched: Schedule, scale: float | None = None,
                  params: tuple | None = None) -> torch.Tensor:
    """gc: the chunk-local cumsum of g ([B,T,H] or [B,T,H,K]) in float32, times `scale` if given; key (chunk,
    g dtype, gate form). For an in-kernel gate form, g is its input and params its (A_log, dt_bias) (gate_args)."""
    gc = torch.empty(g.shape, device=g.device, dtype=torch.float32)
    if sched.num_slots == 0 or g.numel() == 0:
        return gc
    g1 = flat(g)
    A_log, dt_bias, scale = gate_args(g.device, params, scale)
    compiled(chunk_local_cumsum_kernel, *key)(g1.reshape(*g1.shape[:2], -1), A_log, dt_bias, sched.cu,
                                              gc.view(*g1.shape[:2], -1), scale, *sched.grid)
    return gc


def launch_l2norm(key: tuple, x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in x's dtype (contiguous); key (K, dtype)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // key[0]
    if rows:
        compiled(l2norm_kernel, *key)(x.view(rows, key[0]), y.view(rows, key[0]), float(eps))
    return y


def launch_kkt(key: tuple, k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None, sched: Schedule,
               group_steps: int, gate_scale: float | None = None, params: tuple | None = None):
    """(A, gc): A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1 per chunk, [B,T,HV,C] in k's dtype, and the gate's
    fp32 chunk-local cumsum gc; key (chunk, method, dtype, gate, value heads per pass, gate_in). gate_in None: g is
    gc already, the fp32 chunk-local cumsum of the scalar ([B,T,HV]) or per-channel ([B,T,HV,K]) gate, or None
    (ungated), and is returned as it is. gate_in (g dtype, gate form): g is the raw scalar gate [B,T,HV] of that
    form (params its (A_log, dt_bias): gate_args; gate_scale the factor on the sum), which the kernel sums into
    the gc it returns. group_steps: the groups of value heads a CTA runs in turn (plan.kkt_group_steps)."""
    B, Tn, H, K = k.shape
    HV, chunk, gate_in = beta.shape[2], key[0], key[5]
    A = torch.empty(B, Tn, HV, chunk, device=k.device, dtype=k.dtype)
    gc = g if gate_in is None else torch.empty(g.shape, device=g.device, dtype=torch.float32)
    if sched.num_slots == 0:
        return A, gc
    g_in = placeholder(k.device, torch.float32).view(1, 1, 1) if g is None else flat(g)
    A_log, dt_bias, gate_scale = gate_args(k.device, params, gate_scale)
    gc_out = placeholder(k.device, torch.float32) if gate_in is None else flat(gc)
    compiled(kkt_solve_kernel, *key)(flat(k), flat(beta).float(), g_in, A_log, dt_bias, sched.cu, flat(A), gc_out,
                                     HV // H, group_steps, gate_scale, *sched.grid)
    return A, gc


def launch_factors(key: tuple, q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
                   scale: float, sched: Schedule, params: tuple | None = None,
                   gate_scale: float | None = None):
    """(Qg, Kd, Kg, P, Ab, D) of a per-key-channel gate: Q ⊙ exp(gc), K ⊙ exp(gc_last - gc) and (with the delta rule,
    else None) K ⊙ exp(gc) as [B, T, HV, K], the scaled intra-chunk scores as [B, T, HV, 64] and (with the delta rule,
    else None) Ab = A diag(beta) [B, T, HV, 64], A kkt_solve's from beta [B, T, HV], in q's dtype; D = exp(gc_last)
    per tile slot [slots, HV, K] fp32. key (K, dtype, gate_in, delta rule): g [B, T, HV, K] is the raw gate of
    gate_in (params, gate_scale its in-kernel gate's), or the fp32 chunk-local cumsum."""
    B, Tn, H, K = q.shape
    HV = g.shape[2]
    delta = key[3]
    Qg = torch.empty(B, Tn, HV, K, device=q.device, dtype=q.dtype)
    Kd = torch.empty_like(Qg)
    Kg = torch.empty_like(Qg) if delta else None
    P = torch.empty(B, Tn, HV, TILE, device=q.device, dtype=q.dtype)
    Ab = torch.empty_like(P) if delta else None
    D = torch.empty(max(sched.num_slots, 1), HV, K, device=q.device, dtype=torch.float32)
    if sched.num_slots == 0:
        return Qg, Kd, Kg, P, Ab, D
    A_log, dt_bias, gate_scale = gate_args(q.device, params, gate_scale)
    absent = placeholder(q.device, q.dtype)
    compiled(gla_factors_kernel, *key)(flat(q), flat(k), flat(g),
                                       flat(beta).float() if delta else placeholder(q.device, torch.float32),
                                       A_log, dt_bias, sched.cu, flat(Qg), flat(Kd), flat(Kg) if delta else absent,
                                       flat(P), flat(Ab) if delta else absent, D, float(scale), gate_scale,
                                       *sched.grid)
    return Qg, Kd, Kg, P, Ab, D


def launch_state_pass(cfg, q, k, v, g, beta, A, h0, cu, N, kg=None, P=None, warm=None, order=None, o=None, ht=None,
                      h_init=None, first=None, max_chunks=0, initial=False):
    """One state/output launch of PassConfig cfg over N sequences: (o like v, final state [N, HV, K, V] fp32 or
    None), written into o and ht where they are given (contiguous views will do; under the warm-up ht's rows are the
    table's, so the outputs pass's caller gives it). Inputs a configuration does not read (g without a gate; beta
    and A for the plain update; kg and P but after gla_factors, beta after gla_factors' Ab; warm and h_init, the
    call's initial states, but under the split's warm-up, where h_init is ht, unread, without them; first but in
    the warm-up's transitions, which write warm from it, max_chunks and initial) and h0 without an initial state are
    placeholders, as is order (the sequences' launch order, int32 [N]) for the batch order; o is allocated (the
    launch contract fixes its shape) but, without the output group, not written."""
    HV = v.shape[2]
    dev = v.device
    o = torch.empty_like(v) if o is None else o
    if ht is None:
        ht = torch.empty(N if cfg.store_final_state else 1, HV, cfg.K, cfg.V, dtype=torch.float32, device=dev)
    ph = placeholder(dev, torch.float32)
    half = placeholder(dev, q.dtype)
    kernel = compiled(STATE_PASSES[cfg.kernel], *cfg.args, warp_specialized=True)
    kernel(q, k, v, ph if g is None else g, ph if beta is None else beta, half if A is None else A,
           ht if h0 is None else h0, cu, o, ht, half if kg is None else kg, half if P is None else P,
           placeholder(dev, torch.int32) if warm is None else warm, placeholder(dev, torch.int32) if order is None
           else order, h_init if h_init is not None else ht if cfg.warmup else ph,
           placeholder(dev, torch.int32) if first is None else first, int(max_chunks), int(initial))
    return o, (ht if cfg.store_final_state else None)


def launch_combine(key: tuple, B_seg, *args):
    """The split's step 2 (seq_combine.py); key (K, V, transition, reads h0, reads the warm-up table).
    Plain update, launch_combine(key, B_seg, gc, cu_segments, first, h0): (S_in [S, HV, K, V], final [N, HV, K, V])
    fp32 from the transitions' states B_seg, the scalar gate's chunk-local cumsum gc [1, T, HV] (or None), the
    segment table's cu_segments and first, and h0 [N, HV, K, V] (or None).
    Delta rule (transition "matrix"), launch_combine(key, BM, table, h0, warm): S_in [S, HV, K, V] fp32 from the
    transitions' [B | M] [S, HV, K, V + K], the SegmentTable (the kernel over its split sequences; the others'
    rows, their initial states, copied, but under the warm-up, where the outputs pass reads the initial states
    itself and no row of theirs), h0 (or None) and the warm-up table (or None)."""
    kernel = compiled(seq_combine_kernel, *key)
    if key[2] == "matrix":
        table, h0, warm = args
        S_in = B_seg.new_empty(*B_seg.shape[:3], key[1])
        if table.split.numel():
            kernel(B_seg, table.first, table.split, S_in if h0 is None else h0,
                   placeholder(B_seg.device, torch.int32) if warm is None else warm, S_in)
        if table.singles.numel() and warm is None:
            rows = table.single_rows.long()
            if h0 is None:
                S_in.index_fill_(0, rows, 0.0)
            else:
                S_in.index_copy_(0, rows, h0.index_select(0, table.singles))
        return S_in
    gc, cu_segments, first, h0 = args
    S_in = torch.empty_like(B_seg)
    final = B_seg.new_empty(first.shape[0] - 1, *B_seg.shape[1:])
    gc = placeholder(B_seg.device, torch.float32) if gc is None else gc
    kernel(B_seg, gc, cu_segments, first, final if h0 is None else h0, S_in, final)
    return S_in, final


# ---- the pipeline ------------------------------------------------------------------------------------------------
def _check(plan: Plan, q, v, g, beta, initial_state, sched: Schedule):
    """The inputs agree with the plan's host sizes (the device-side tables cannot check the lengths themselves)."""
    tokens = q.shape[0] * q.shape[1]
    if (tokens, sched.N, q.shape[2], v.shape[2], q.shape[3], v.shape[3]) != (
            plan.tokens, len(plan.lengths), plan.H, plan.HV, plan.K, plan.V):
        raise ValueError(f"plan: made for {plan.tokens} tokens in {len(plan.lengths)} sequences, H={plan.H}, "
                         f"HV={plan.HV}, K={plan.K}, V={plan.V}; got {tokens} tokens in {sched.N} sequences, "
                         f"H={q.shape[2]}, HV={v.shape[2]}, K={q.shape[3]}, V={v.shape[3]}")
    if (g is None) != (plan.gate == "none") or (beta is None) != (not plan.delta):
        shape = lambda x: "None" if x is None else list(x.shape)  # noqa: E731
        raise ValueError(f"plan: made for gate {plan.gate!r} and delta rule {plan.delta}; got g {shape(g)}, beta "
                         f"{shape(beta)}")
    if (initial_state is not None) != plan.initial_state:
        raise ValueError(f"plan: made {'with' if plan.initial_state else 'without'} an initial state, got "
                         f"initial_state {'None' if initial_state is None else list(initial_state.shape)}")


def forward(plan: Plan, q, k, v, g, beta, initial_state=None, cu_seqlens=None, *, A=None, gate_params=None,
            gate_scale=None):
    """Run a plan: (o [B, T, HV, V] in q's dtype, final state [N, HV, K, V] fp32 or None; o None when the plan keeps
    the state alone). g: the raw log gate ([B, T, HV] or [B, T, HV, K]), its chunk-local cumsum for a plan made
    with g_input="cumsum", or the in-kernel gate's input for a plan with a gate form (gate_params its (A_log,
    dt_bias) of tilela._gates.param_shapes, gate_scale the sigmoid form's lower bound); beta [B, T, HV]
    for the delta rule; initial_state [N, HV, K, V]. A: the UT transform to use instead of kkt_solve's (the delta
    rule without gla_factors, which forms Ab itself; tests isolate the state pass with it)."""
    sched = Schedule.of(q, cu_seqlens)
    _check(plan, q, v, g, beta, initial_state, sched)
    if A is not None and (not plan.kkt or plan.kkt[5] is not None):
        raise ValueError(f"A: a plan that runs kkt_solve on the chunk-local cumsum (g_input='cumsum') takes an A of "
                         f"its own; this one has {'none' if not plan.kkt else 'one that sums the gate'} (delta rule "
                         f"{plan.delta}, gla_factors {plan.factors is not None}), got A {list(A.shape)}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    A = None if A is None else A.contiguous()
    if g is not None:
        g = g.contiguous() if g.dtype in DTYPE_NAMES else g.float().contiguous()
        g = launch_cumsum(plan.cumsum, g, sched, gate_scale, gate_params) if plan.cumsum else g
    if plan.delta:
        beta = beta.contiguous() if beta.dtype in (torch.float32, q.dtype) else beta.float().contiguous()
        if A is None and plan.kkt:
            A, g = launch_kkt(plan.kkt, k, beta, g, sched, plan.kkt_steps, gate_scale, gate_params)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    if plan.pipeline is not None:
        return _pipelined(plan, q, k, v, g, beta, h0, gate_params, gate_scale)
    kg = P = None
    if plan.factors:  # the state-independent factors first, in the q, k, g, kg and P slots (chunk_fwd_ws.py)
        # over the split's segments, the layout both its passes index D by (segments start at chunk boundaries)
        segments = None if plan.split is None else segment_table(plan.split, q.device).cu_segments
        tiles = sched if segments is None else Schedule.of(flat(q), segments)
        q, k, kg, P, A, g = launch_factors(plan.factors, q, k, g, beta, plan.output.scale, tiles, gate_params,
                                           gate_scale)
        beta = None  # in Ab
    elif g is not None:
        g = g.float()
    if plan.split is None:
        order = None if plan.order is None else device_table(list, plan.order, q.device)
        o, ht = launch_state_pass(plan.output, q, k, v, g, beta, A, h0, sched.cu, sched.N, kg, P, order=order)
    else:
        o, ht = _split(plan, q, k, v, g, beta, A, h0, kg, P)
    return (o if plan.output.store_output else None), ht


def _pipelined(plan: Plan, q, k, v, g, beta, h0, gate_params, gate_scale):
    """The token-range pipeline (seq_pipeline.pipeline_forward) over the plan's ranges of its one sequence ([1, T]
    tensors, dense or varlen): gla_factors over each range's tiles, then the plan's passes (the first range's, then
    the others') on its factors, dense over the range."""
    cu = placeholder(q.device, torch.int32)

    def factors(q, k, g, beta):
        return launch_factors(plan.factors, q, k, g, beta, plan.output.scale, Schedule.of(q, None), gate_params,
                              gate_scale)

    def state_pass(r, made, v, h0, o, ht):
        Qg, Kd, Kg, P, Ab, D = made
        launch_state_pass(plan.passes[min(r, 1)], Qg, Kd, v, D, None, Ab, h0, cu, 1, Kg, P, o=o, ht=ht)

    return seq_pipeline.pipeline_forward(factors, state_pass, q, k, v, g, beta, h0, plan.output_final_state,
                                         plan.pipeline, seq_pipeline.pass_stream(v.device))


def _split(plan: Plan, q, k, v, g, beta, A, h0, kg=None, P=None):
    """The state pass over the plan's segments (seq_split.split_forward) with its transitions, combine and output
    launches bound to the plan's keys. After gla_factors (kg, P given) the passes take its factors: kg and P as the
    other token inputs, flat, and its decays D (in g) by the segments' tile slots, which the split's gate-free
    delta-rule combine never reads."""
    transitions, outputs = plan.passes
    D = None if kg is None else g  # after gla_factors, g holds D
    kg, P = (None, None) if kg is None else (flat(kg), flat(P))

    def run(cfg):
        def state_pass(q, k, v, g, beta, A, h0, cu, order, warm=None, h_init=None):
            segments, N = cu.shape[0] - 1, len(plan.split.lengths)
            # under the warm-up the outputs store at the table's rows: the sequences' final states and one no one reads
            rows = cfg.warmup and cfg.store_output and cfg.store_final_state
            ht = v.new_empty(N + 1, v.shape[2], cfg.K, cfg.V, dtype=torch.float32) if rows else None
            o, ht = launch_state_pass(cfg, q, k, v, g if D is None else D, beta, A, h0, cu, segments, kg, P,
                                      warm=warm, order=order, ht=ht, h_init=h_init)
            return o, (ht[:N] if rows else ht)
        return state_pass

    def warming(q, k, v, g, beta, A, h0, cu, order, first, max_chunks, initial):
        """The transitions under GDN's warm-up: (the warm-up table they form, [B | M])."""
        warm = torch.empty(3, cu.shape[0] - 1, v.shape[2], device=v.device, dtype=torch.int32)
        _, BM = launch_state_pass(transitions, q, k, v, g, beta, A, h0, cu, cu.shape[0] - 1, warm=warm, order=order,
                                  first=first, max_chunks=max_chunks, initial=initial)
        return warm, BM

    combine = functools.partial(launch_combine, plan.combine)
    return seq_split.split_forward(warming if plan.output.warmup else run(transitions), run(outputs), combine, q, k,
                                   v, g if D is None else None, beta, A, h0, plan.output_final_state, plan.split,
                                   plan.output.warmup)
