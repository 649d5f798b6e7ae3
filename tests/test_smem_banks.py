"""benchmarks/smem_banks.py counts shared-memory wavefronts as ncu does (its cases measured on kkt_solve, H100)."""

import pytest

HEADER = ("extern \"C\" __global__ void __launch_bounds__(128, 4) k() {\n"
          "  void* Lo = ((void*)((char*)buf_dyn_shmem + 0));\n"
          "  void* L1 = ((void*)((char*)buf_dyn_shmem + 16384));\n")


def rows_of(smem_banks, body: str):
    return smem_banks.count(HEADER + body + "}\n", 128)


@pytest.mark.parametrize("width, stride, expected", [
    (4, 4, (1, 1)),  # consecutive floats: one wavefront
    (4, 64, (16, 1)),  # a column of 16-float rows: two banks, 16 words each
    (16, 16, (4, 4)),  # float4 rows: four phases of 128 bytes
    (8, 8, (2, 2)),
    (4, 0, (1, 1)),  # one word for all lanes: a broadcast
])
def test_phase_wavefronts(smem_banks, width, stride, expected):
    lanes = 32 * 4 // max(width, 4)
    total = ideal = 0
    for phase in range(0, 32, lanes):
        w, i = smem_banks.phase_wavefronts([lane * stride for lane in range(phase, phase + lanes)], width)
        total, ideal = total + w, ideal + i
    assert (total, ideal) == expected


def test_transposed_reads_of_a_16_float_block_are_eight_way(smem_banks):
    """kkt_solve's level-1 operand staging on main read Lo[q, m, s] with m across the lanes (rows of 16 floats,
    blocks of 17 rows): ncu counted 524 k wavefronts for 66 k warp instructions, 8 a warp."""
    body = ("  #pragma unroll\n  for (int i_3 = 0; i_3 < 8; ++i_3) {\n"
            "    ((half_t*)L1)[((((int)threadIdx.x) * 16) + i_3)] = ((half_t)((float*)Lo)[(((((i_3 >> 1) * 272) + "
            "((((int)threadIdx.x) & 15) * 16)) + ((i_3 & 1) * 8)) + (((int)threadIdx.x) >> 4))]);\n  }\n")
    (store, load) = rows_of(smem_banks, body)
    assert (load[1], load[2], load[4], load[5], load[6]) == ("ld", "Lo", 8, 8.0, 1.0)
    assert (store[1], store[2]) == ("st", "L1")


def test_vector_store_and_ldmatrix_are_read_with_their_widths(smem_banks):
    body = ("  *(uint2*)(((half_t*)L1) + (((int)threadIdx.x) * 4)) = v;\n"
            "  tl::ptx_ldmatrix_x4((&(((half_t*)L1)[(((int)threadIdx.x) * 16)])), (&(A_local[0])));\n"
            "  x = ((float*)Lo)[((int)threadIdx.x)] + local[0];\n")
    kinds = [(kind, buf, width, w) for _, kind, buf, width, _, w, *_ in rows_of(smem_banks, body)]
    # uint2 at 8 bytes a lane: two phases of 16 lanes, one wavefront each; ldmatrix rows 32 bytes apart: 8 lanes
    # cover 256 bytes, two wavefronts a phase; the scalar load of consecutive floats: one
    assert kinds == [("st", "L1", 8, 2.0), ("ldmatrix", "L1", 16, 8.0), ("ld", "Lo", 4, 1.0)]


def test_unknown_names_are_reported_and_taken_as_zero(smem_banks):
    body = "  y = ((float*)Lo)[((((int)threadIdx.x) * 4) + (start * 256))];\n"
    (row,) = rows_of(smem_banks, body)
    assert row[7] == ["start"] and row[5] == 4.0


def test_loop_counters_are_scoped_by_braces(smem_banks):
    """A counter bound by a loop that has closed is unknown again; `} else {` closes its branch first."""
    body = ("  for (int i_1 = 0; i_1 < 4; ++i_1) {\n    if (c) {\n      a = 1;\n    } else {\n"
            "      y = ((float*)Lo)[((((int)threadIdx.x) * 4) + (i_1 * 128))];\n    }\n  }\n"
            "  z = ((float*)Lo)[(((int)threadIdx.x) + (i_1 * ((int)blockIdx.x)))];\n")
    inside, after = rows_of(smem_banks, body)
    assert (inside[4], inside[7]) == (4, [])
    assert (after[4], after[7]) == (1, ["block_x", "i_1"])


def test_a_branch_on_the_thread_index_runs_its_own_warps(smem_banks):
    """An access under `if (threadIdx.x < N)` counts the warps in range, its `else` the others, nested branches the
    intersection; a branch on anything else runs every warp of its scope."""
    store = "    ((float*)Lo)[((int)threadIdx.x)] = 0.0f;\n"
    body = (store + "  if (((int)threadIdx.x) < 32) {\n" + store + "  } else {\n"
            "    if (((int)threadIdx.x) < 64) {\n" + store + "    } else {\n" + store + "    }\n  }\n"
            "  if (r == 1) {\n" + store + "  } else {\n" + store + "  }\n")
    assert [row[-1] for row in rows_of(smem_banks, body)] == [4, 1, 1, 2, 4, 4]
