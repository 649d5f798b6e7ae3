"""The benchmark registry on the CPU: every op's module imports, its case grid is what the issues ask for,
and every case has a roofline (bytes, FLOPs) — the timing itself needs a GPU."""

import importlib

import pytest

from tilela import bench


@pytest.mark.parametrize("op", sorted(bench.OPS))
def test_every_case_has_a_floor(op):
    spec = importlib.import_module(bench.OPS[op]).BENCH
    full, quick = spec.cases(False), spec.cases(True)
    assert quick and len(quick) < len(full)
    assert {c.name for c in quick} <= {c.name for c in full}
    for case in full + spec.check_cases:
        cost = spec.cost(case)
        assert cost["bytes"] > 0 and cost["flops"] >= 0  # a cumsum has no matrix FLOPs
    assert len({c.name for c in full}) == len(full)


def test_gdn_grid_is_the_issue_grid():
    from tilela.bench import gdn

    names = {c.name for c in gdn.cases(False)}
    assert len(names) == 6 * 6 * 2  # head configs x layouts x gate regimes
    assert "28672+4096_h16-64_decay" in names and "1024x8_h2-8_mixed" in names


def test_markdown_ratios_and_floor():
    rec = dict(op="x", case="c", params={}, rel_err=None, floor_ms=0.5)
    table = bench.markdown([dict(rec, impl="ours", ms=1.0), dict(rec, impl="theirs", ms=2.0)])
    assert "| c | 1.0000 | 2.0000 (2.00) | 0.5000 | 2.00 |" in table
