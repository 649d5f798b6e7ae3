"""benchmarks/ncu_regions.py splits ncu's SASS source page into barrier-delimited regions and sums its samples."""

import csv

COLUMNS = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
           "Instructions Executed", "stall_barrier", "stall_short_sb", "stall_barrier (Not Issued)"]
ROWS = [  # source, samples, executed, barrier stalls, short-scoreboard stalls
    ("LDS.128 R4, [R1]", 10, 100, 0, 10),
    ("@!P1 FMUL R4, R4, R5", 2, 100, 0, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 8, 100, 8, 0),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R7+URZ], R4", 5, 50, 0, 5),
    ("FFMA R2, R3, R4, R2", 25, 650, 0, 20),
    ("EXIT", 0, 0, 0, 0),
]


def write(path):
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Kernel Name", "k", ""])
        out.writerow(COLUMNS)
        for i, (source, samples, executed, barrier, short) in enumerate(ROWS):
            out.writerow([hex(i * 16), "      " + source, samples, samples, executed, barrier, short, 0])


def test_regions_close_at_barriers_and_waits(ncu_regions, tmp_path):
    path = tmp_path / "source.csv"
    write(path)
    result = ncu_regions.analyse(*ncu_regions.read(str(path)))
    assert result["samples"] == 50 and result["executed"] == 1000
    assert [(g["first"], g["last"]) for g in result["regions"]] == [(0, 2), (3, 3), (4, 5)]
    assert [g["samples"] for g in result["regions"]] == [20, 5, 25]
    assert result["opcodes"]["FMUL"] == 2 and result["opcodes_executed"]["FFMA"] == 650  # predicate stripped
    assert result["stalls"] == {"barrier": 8, "short_sb": 35}  # the not-issued columns left out


def test_report_leaves_out_small_regions(ncu_regions, tmp_path):
    path = tmp_path / "source.csv"
    write(path)
    text = ncu_regions.report(ncu_regions.analyse(*ncu_regions.read(str(path))), min_share=0.2, opcodes=3)
    assert "    0..    2  40.0%  30.0%" in text and "    4..    5  50.0%  65.0%" in text
    assert "    3..    3" not in text  # 10% of the samples
