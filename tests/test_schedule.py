"""The varlen tile schedule of the tile-parallel kernels (common.locate_tile), on the CPU: a model of one warp's
search, round by round as the kernel runs it, against the slot map's definition (tile slot s belongs to the last
sequence n with floor(cu[n] / 64) + n <= s), for search_rounds(N) rounds at every slot of the grid."""

import pytest
import torch

from tilela.kernels.hopper.common import SEARCH_WAYS, TILE, search_rounds
from tilela.kernels.hopper.launch import Schedule


def warp_search(cu: list[int], slot: int, rounds: int) -> tuple[int, int]:
    """locate_tile's [start, end) for one slot: per round each lane's probe and the warp's ballot of those that
    pass, then the last round's lane hits - 1 hands over cu[n] and cu[n + 1]."""
    lo, width, hits, probes = 0, len(cu) - 1, 1, []
    for _ in range(rounds):
        stride = -(-width // SEARCH_WAYS)
        probes = [lo + min(lane * stride, width - 1) for lane in range(SEARCH_WAYS)]
        ballot = [lane * stride < width and cu[m] // TILE + m <= slot for lane, m in enumerate(probes)]
        hits = sum(ballot)
        assert ballot == [True] * hits + [False] * (SEARCH_WAYS - hits)  # the passing probes come first
        width = min(stride, width - (hits - 1) * stride)
        lo += (hits - 1) * stride
    m = probes[hits - 1]
    assert m == lo  # the last round's stride is 1: the handing lane probed the sequence itself
    first = cu[m]
    return first + (slot - first // TILE - lo) * TILE, cu[m + 1]


def slot_map(cu: list[int], slots: int) -> list[tuple[int, int]]:
    """[start, end) of every slot by the definition (surplus slots: start >= end)."""
    out = []
    for s in range(slots):
        n = max(i for i in range(len(cu) - 1) if cu[i] // TILE + i <= s)
        out.append((cu[n] + (s - cu[n] // TILE - n) * TILE, cu[n + 1]))
    return out


@pytest.mark.parametrize("N", [1, 2, 5, 31, 32, 33, 100, 1024, 1025, 1500])
def test_warp_search_finds_every_tile(N):
    gen = torch.Generator().manual_seed(N)
    lengths = torch.randint(1, 200, (N,), generator=gen)
    lengths[:: max(N // 7, 1)] = 1  # length-1 sequences among them
    cu = [0] + torch.cumsum(lengths, 0).tolist()
    sched = Schedule.of(torch.zeros(1, cu[-1]), torch.tensor(cu))
    assert sched.search_steps == search_rounds(N) == (1 if N <= 32 else 2 if N <= 1024 else 3)
    expected = slot_map(cu, sched.num_slots)
    assert [warp_search(cu, s, sched.search_steps) for s in range(sched.num_slots)] == expected
    tiles = {(start, end) for start, end in expected if start < end}  # each tile of each sequence exactly once
    assert len(tiles) == sum(-(-int(n) // TILE) for n in lengths)


def test_dense_layout_has_no_search():
    sched = Schedule.of(torch.zeros(3, 130), None)
    assert (sched.num_slots, sched.dense_len, sched.search_steps) == (9, 130, 0)
