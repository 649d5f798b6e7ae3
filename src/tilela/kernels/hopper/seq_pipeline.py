"""The token-range pipeline: one sequence's state-independent factors and its state pass, range by range, the pass of
a range running beside the factors of the next. Mirrors reference layer B over the ranges (reference.chunked from
each range's entering state):

    ranges      [t_0, t_1), [t_1, t_2), ... of the sequence, cut at chunk boundaries (plan.pipeline)
    factors     F_r = gla_factors(q, k, g, beta over range r)          on the current stream, range by range
    pass        o_r, S(t_{r+1}) = state pass(F_r, v_r, S(t_r))           on a second stream of higher priority,
                                                                         after F_r and the pass of range r - 1

Ranges start at chunk boundaries, so every chunk's factors, chunk-local gate sums and A are those of the unpipelined
call, and the pass carries its fp32 state from range to range through the final and initial state slots: the
result is the unpipelined call's. While the pass of range r runs its serial chain of chunks on its few CTAs, the
factors of range r + 1 fill the other SMs. Nothing synchronises with the host, and the two streams fork from and
join the current one (event waits), so a CUDA graph captures the pipeline. The ranges and the pass's DV block come
from the plan's cost model (plan.auto_pipeline).

The stages are given as functions (pipeline_forward): the TileLang launches of the plan on the GPU (launch.py), any
other implementation of the same contract elsewhere.
"""

import contextlib
import functools

import torch


@functools.lru_cache(maxsize=None)
def pass_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's stream for the pipeline's passes, of the highest priority, so that their CTAs start before the
    factors' waiting ones."""
    return torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1])


def pipeline_forward(factors, state_pass, q, k, v, g, beta, initial_state, output_final_state, bounds, stream=None):
    """(o [1, T, HV, V], final state [1, HV, K, V] or None) of one sequence in ranges: q, k [1, T, H, K], v [1, T,
    HV, V], g and beta (or None) over the same tokens; initial_state [1, HV, K, V] fp32 or None; bounds the ranges'
    token boundaries (0, ..., T), inner ones at chunk boundaries.

    factors(q_r, k_r, g_r, beta_r) -> the range's pass inputs (any tuple), on the current stream;
    state_pass(r, inputs, v_r, h0, o_r, ht) writes o_r (a view of o) and the range's final state into ht [1, HV, K,
    V] (fp32; float64 for float64 inputs) from h0 (the entering state, None at the start of a sequence without an
    initial state); r the range's index. stream: where the passes run (pass_stream on a GPU), or None: every stage
    in order on the current one."""
    K, HV, V = k.shape[-1], v.shape[2], v.shape[3]
    o = torch.empty_like(v)
    state = torch.promote_types(v.dtype, torch.float32)
    handed = v.new_empty(2, 1, HV, K, V, dtype=state)  # range r's final state in handed[r % 2]
    final = v.new_empty(1, HV, K, V, dtype=state)
    side = contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
    here = None if stream is None else torch.cuda.current_stream(v.device)
    ranges = list(zip(bounds[:-1], bounds[1:]))

    def factors_of(a, b):
        return factors(*(None if x is None else x[:, a:b] for x in (q, k, g, beta)))

    # every range's inputs are kept to the join: freed earlier, the current stream could reuse them under a pass
    made = [factors_of(*ranges[0])]
    h = initial_state
    for r, (a, b) in enumerate(ranges):
        if stream is not None:
            stream.wait_stream(here)  # the range's factors (and o, the states: made on the current stream)
        ht = final if r == len(ranges) - 1 else handed[r % 2]
        with side:
            state_pass(r, made[r], v[:, a:b], h, o[:, a:b], ht)
        if r + 1 < len(ranges):
            made.append(factors_of(*ranges[r + 1]))
        h = ht
    if stream is not None:
        here.wait_stream(stream)
    return o, (final if output_final_state else None)
