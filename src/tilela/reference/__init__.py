"""float64 reference stack of the chunkwise linear-attention family (linear_attn, delta_rule, simple_gla, GDN,
gla, KDA) as one model: S_t = diag(exp g_t) S_{t-1}; delta rule S_t += k_t (beta_t (v_t - k_t^T S_t))^T or plain
S_t += k_t v_t^T; o_t = scale q_t^T S_t.

Layers, each checked against the previous one:  A recurrent (definition), B chunked (vectorised chunk
identities), C seq_in_grid (kernel control flow, sequence in the grid), D seq_in_loop (production layout,
sequence loop inside, DV split), E seq_split (segments of a sequence in parallel from entering states composed
from the segments' affine transitions). Primitives: chunk_local_cumsum, kkt_solve and the unit-lower-triangular
inverses of reference.inverse with their cost model.
"""
from .chunked import chunked
from .cumsum import chunk_local_cumsum
from .inverse import (blocked_inverse, flat_block_inverse, inverse_cost, neumann_inverse_16, row_forward_inplace,
                      solve_unit_lower)
from .kkt import kkt_solve
from .recurrent import recurrent
from .seq_in_grid import seq_in_grid
from .seq_in_loop import seq_in_loop
from .seq_split import (WARMUP_BOUND, entering_states, initial_row, seq_split, transition_entering_states,
                        warmup_outputs, warmup_table)

__all__ = [
    "recurrent", "chunked", "seq_in_grid", "seq_in_loop", "seq_split", "entering_states", "transition_entering_states",
    "warmup_table", "warmup_outputs", "initial_row", "WARMUP_BOUND", "chunk_local_cumsum", "kkt_solve",
    "row_forward_inplace", "blocked_inverse", "flat_block_inverse", "neumann_inverse_16", "solve_unit_lower",
    "inverse_cost",
]
