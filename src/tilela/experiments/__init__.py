"""Kernels kept to measure a design against the shipped one, not used by the ops (the ladder benchmark's
`tilela_seq_in_grid` column and its GPU test): linear_attn_seq_in_grid, ladder level 1 with the sequence axis in
the grid (seed 002 §4)."""
