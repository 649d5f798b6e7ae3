"""benchmarks/sass_groups.py splits a SASS listing into warp groups at USETMAXREG and counts their loop bodies."""

LISTING = [  # address, instruction
    (0x00, "S2R R0, SR_TID.X"),
    (0x10, "@P0 BRA 0x100"),
    (0x20, "USETMAXREG.DEALLOC.CTAPOOL 0x38"),
    (0x30, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R20"),   # loop: 0x30-0x70 with a spin wait inside
    (0x40, "@!P0 BRA 0x30"),
    (0x50, "HGMMA.64x16x16.F32.BF16 R24, gdesc[UR40], RZ, !UPT"),
    (0x60, "@!P1 LDS.64 R20, [R44+0x34600]"),
    (0x70, "@P2 BRA 0x30"),
    (0x80, "EXIT"),
    (0x90, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd0"),
    (0xa0, "MUFU.EX2 R1, R1"),
    (0xb0, "EXIT"),
    (0xc0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R20"),  # an out-of-line retry: left out
    (0xd0, "BRA 0x40"),
]


def listing():
    return "\n".join(f"        /*{a:04x}*/                   {s} ;   /* 0x000000 */\n      /* 0x0000 */"
                     for a, s in LISTING)


def test_sections_split_at_setmaxnreg_and_stop_at_the_last_exit(sass_groups):
    parts = sass_groups.sections(sass_groups.instructions(listing()))
    assert [p["registers"] for p in parts] == [None, 56, 208]
    assert [len(p["code"]) for p in parts] == [2, 7, 3]


def test_loops_are_outermost_bodies_of_min_size(sass_groups, monkeypatch):
    code = sass_groups.sections(sass_groups.instructions(listing()))[1]["code"]
    monkeypatch.setattr(sass_groups, "MIN_LOOP", 1)
    (body,) = sass_groups.loops(code)
    assert (body[0][0], body[-1][0]) == (0x30, 0x70)
    assert sass_groups.counts(body) == {"SYNCS": 1, "BRA": 2, "HGMMA": 1, "LDS": 1}  # predicates stripped
    monkeypatch.setattr(sass_groups, "MIN_LOOP", 6)
    assert sass_groups.loops(code) == []


def test_report_names_groups_by_registers(sass_groups, monkeypatch):
    monkeypatch.setattr(sass_groups, "MIN_LOOP", 1)
    text = sass_groups.report(listing(), opcodes=2)
    assert text.splitlines()[:3] == ["prologue: 2 instructions", "group 1 (56 registers): 7 instructions",
                                     "  loop 0x30-0x70: 5 instructions; HGMMA 1 LDS 1 SYNCS 1"]
