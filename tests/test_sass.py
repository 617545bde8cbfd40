"""mlagen.tools.sass and `mlagen show --sass/--opcodes`: SASS read on a CPU-only machine."""

import re

import pytest
from typer.testing import CliRunner

from cli import app
from mlagen.codegen.build import build
from mlagen.codegen.compiler import compile_source
from mlagen.codegen.render import render
from mlagen.dsl.spec import Problem, parse_variant
from mlagen.plan.mma_plan import TRANSPOSED_STACK
from mlagen.plan.validate import validate
from mlagen.tools import sass

runner = CliRunner()
MATRIX = pytest.mark.compile_matrix
WGMMA = "mma_ht64_qt1_bn64_w8_st2_spa_sm90a"


def _built(name: str):
    return build(Problem(heads=64), parse_variant(name))


def _benchmark(name: str):
    """A script of benchmarks/ as a module."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    return importlib.import_module(name)


def _plan(name: str, heads: int = 64):
    """Variant `name`'s plan for the H=`heads` problem, without compiling it."""
    return validate(Problem(heads=heads), parse_variant(name))


def _main_sass(name: str) -> str:
    """The SASS of variant `name`'s main kernel (H=64 problem), for its own arch."""
    b = _built(name)
    return sass.disassemble(b.module.cubin, b.plan.main_kernel, b.plan.arch.name)


def _needs_nvdisasm() -> None:
    try:
        sass.find_nvdisasm()
    except sass.SassError as e:
        pytest.skip(str(e))


def test_kernel_code_is_the_kernels_section():
    b = _built("naive_w4_sm90")
    code = sass.kernel_code(b.module.cubin, b.plan.main_kernel)
    assert code and len(code) % 16 == 0          # 128-bit instructions since sm_70
    with pytest.raises(sass.SassError, match="no code section for kernel 'nope'"):
        sass.kernel_code(b.module.cubin, "nope")
    with pytest.raises(sass.SassError, match="ELF"):
        sass.kernel_code(b"not a cubin", b.plan.main_kernel)


def test_wgmma_kernel_sass_shows_the_design():
    """What the sm_90a kernel's design promises, read from its SASS: both products on wgmma,
    the KV loader's copies at constant offsets from a per-row base, and no local memory."""
    _needs_nvdisasm()
    text = _main_sass(WGMMA)
    counts = sass.opcodes(text)
    assert sum(counts.values()) == len(text.splitlines())
    assert "HGMMA.64x32x16" in text and "HGMMA.64x256x16" in text
    assert counts["LDL"] == counts["STL"] == 0
    # Copies after a row's first: shared and global address both a register plus a constant
    # (a loader that computes every address gives 0 of 27 copies like this).
    copies = [line for line in text.splitlines() if "LDGSTS" in line]
    constant = [c for c in copies if re.search(r"\[R\d+\+0x[0-9a-f]+\], desc\[UR\d+\]\[R\d+\.64\+0x[0-9a-f]+\]", c)]
    assert copies and len(constant) >= 0.8 * len(copies)


def test_wgmma_kernel_refills_between_its_score_wgmmas():
    """The next tile's copies go out between the 36 score wgmmas (one column block per 4
    k-steps, 2 rows per thread: 16 copies before the last block's wgmmas), with their row
    lookups done a tile earlier, so no global load sits among them."""
    _needs_nvdisasm()
    lines = _main_sass(WGMMA).splitlines()
    scores = [i for i, line in enumerate(lines) if "HGMMA.64x32x16" in line]
    assert len(scores) == 36
    span = lines[scores[0]:scores[-1]]
    assert sum("LDGSTS" in line for line in span) == 16
    assert not any(re.search(r"\bLDG\.", line) for line in span)


@pytest.mark.parametrize("name", [WGMMA, "mma_ht64_qt1_bn64_w8_st2_spb_sm90a"])
def test_score_wgmma_descriptors_stay_in_uniform_registers(name):
    """The score wgmmas' shared-memory descriptors are uniform-register arithmetic: no R2UR
    among them. When a balanced kernel's segment loop took its bounds from 64-bit divisions,
    ptxas treated the tile loop as divergent, put 69 R2UR there, and a tile ran 17% slower."""
    _needs_nvdisasm()
    lines = _main_sass(name).splitlines()
    scores = [i for i, line in enumerate(lines) if "HGMMA.64x32x16" in line]
    assert len(scores) == 36
    assert not [line for line in lines[scores[0]:scores[-1]] if "R2UR" in line]


@pytest.mark.parametrize("name", [WGMMA, "mma_ht64_qt1_bn64_w8_st1_spa_pvm_sm90a"])
def test_split_blocks_count_themselves_done_without_a_sequentially_consistent_fence(name):
    """A split block publishes its partials with one gpu-scope release by the counting thread
    after the block barrier; the per-thread __threadfence() before it was an SC fence in every
    warp (MEMBAR.SC.GPU)."""
    _needs_nvdisasm()
    text = _main_sass(name)
    assert "MEMBAR.SC" not in text
    assert text.count("MEMBAR.ALL.GPU") == 1


def test_epilogue_writes_16_byte_rows():
    """The epilogue stages the output rows in shared memory and each warp writes whole rows in
    16-byte lanes (out or the fp32 partial); stored from the accumulator layout, ptxas splits
    every float2 partial store in two (203 32-bit STG, each warp store touching 8 rows)."""
    _needs_nvdisasm()
    stores = re.findall(r"\bSTG\.E(\.\d+)? ", _main_sass(WGMMA))
    assert stores.count(".128") >= 1
    assert stores.count("") < 40


def test_cluster_split_combines_in_shared_memory():
    """A cluster split's blocks meet at two cluster barriers (rows staged; rows read) and read
    each other's rows through the cluster window: no split counter (ATOMG) and no merge wait."""
    _needs_nvdisasm()
    text = _main_sass("mma_ht64_qt1_bn64_w8_st2_sp4_cl_sm90a")
    assert text.count("UCGABAR_ARV") == 2 and text.count("UCGABAR_WAIT") == 2
    assert "ATOMG" not in text and "NANOSLEEP" not in text
    assert re.search(r"\bLD\.E\.128\b", text)                 # 16-byte reads of the peers' rows
    assert re.search(r"\bSTG\.E\.64\b", text)                 # 8-byte stores of 4 output values


def test_part16_rows_move_in_16_byte_pieces():
    """part16: the epilogue stages each row as 16-bit values and copies it out in 16-byte
    stores (no 8-byte fp32 pieces), and the merges read partial rows in 16-byte loads; the
    cluster combine reads half the bytes of an fp32 one through the window and stores 8 output
    values at a time."""
    _needs_nvdisasm()
    text = _main_sass("mma_ht64_qt1_bn64_w8_st2_spa_p16_sm90a")
    assert re.search(r"\bSTG\.E\.128\b", text) and not re.search(r"\bSTS\.64\b", text)
    # the merge blocks: 6 + 6 rows of 2 loads a lane; a pair's merge: 4 rows (PAIR_BATCH) of 2
    assert len(re.findall(r"\bLDG\.E\.128\.STRONG\.GPU\b", text)) == 24 + 8
    fp32 = _main_sass("mma_ht64_qt1_bn64_w8_st2_sp4_cl_sm90a")
    half = _main_sass("mma_ht64_qt1_bn64_w8_st2_sp4_cl_p16_sm90a")
    assert 2 * half.count("LD.E.128") == fp32.count("LD.E.128")
    assert re.search(r"\bSTG\.E\.128\b", half) and not re.search(r"\bSTG\.E\.64\b", half)


def test_tma_kernel_loads_kv_tiles_as_boxes():
    """tma: a KV tile is D/64 = 9 UTMALDG boxes (both stages' first tiles issued before the
    loop, one refill in it), and the only cp.async copies left are Q's (9 column blocks x 2 passes of 32 rows)."""
    _needs_nvdisasm()
    counts = []
    for name in (WGMMA, "mma_ht64_qt1_bn64_w8_st2_spa_tma_sm90a"):
        b = _built(name)
        ops = sass.opcodes(sass.disassemble(b.module.cubin, b.plan.main_kernel, "sm_90a"))
        counts.append((ops["UTMALDG"], ops["LDGSTS"]))
    assert counts[1] == (27, 18) and counts[0][0] == 0 and counts[0][1] > 18


def test_seesaw_kernel_runs_each_tile_once_on_whole_tile_wgmmas():
    """seesaw: each warpgroup's branch has a whole tile's 36 m64n64 score steps and 8 P·V steps
    (4 from registers, 4 from shared memory); tiles arrive in parts (18 boxes for the first pair
    before the loop, 18 refills in it) and only Q still uses cp.async."""
    _needs_nvdisasm()
    b = _built("mma_ht64_qt1_bn64_w8_st2_spa_tma_ss_sm90a")
    ops = sass.opcodes(sass.disassemble(b.module.cubin, b.plan.main_kernel, "sm_90a"))
    assert (ops["HGMMA"], ops["UTMALDG"], ops["LDGSTS"]) == (2 * (36 + 8), 36, 18)


@pytest.mark.parametrize("size", [2, 5, 8])
def test_p_exchange_moves_p_by_bulk_copies_after_one_cluster_barrier(size):
    """The P exchange: the scores' 36 m64n32 steps, 4 m64n64 value steps a tile of the cluster
    (P and V from shared memory), two unrolled sends a peer (the maxima, then the slot) as bulk
    copies between the blocks' shared memory, and one cluster barrier, whose arrival and release
    (the only GPU-scope fence) come before the wait for the previous grid, where nothing is in
    flight. No split counter, no merge."""
    _needs_nvdisasm()
    b = build(Problem(heads=64, lse=True), parse_variant(f"mma_ht64_qt1_bn64_w8_st1_sp{size}_cl_px_sm90a"))
    text = sass.disassemble(b.module.cubin, b.plan.main_kernel, "sm_90a")
    steps = re.findall(r"\bHGMMA\.(64x32x16|64x64x16)\.F32\.BF16\b", text)
    assert (steps.count("64x32x16"), steps.count("64x64x16")) == (36, 4 * size)
    ops = sass.opcodes(text)
    assert (ops["UBLKCP"], ops["UCGABAR_ARV"], ops["UCGABAR_WAIT"], ops["ATOMG"]) == (2 * size, 1, 1, 0)
    lines = text.splitlines()
    def first(op: str) -> int:
        return next(i for i, line in enumerate(lines) if op in line)

    fences = [i for i, line in enumerate(lines) if "MEMBAR.ALL.GPU" in line]
    assert len(fences) == 1 and fences[0] < first("UCGABAR_ARV") < first("ACQBULK") < first("LDGSTS")


# Instructions that touch global memory (loads, copies, stores, atomics, generic accesses).
GLOBAL_ACCESS = re.compile(r"\b(LDG|LDGSTS|STG|ATOMG|RED|LD|ST)\b")


@pytest.mark.parametrize("name", ["mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a",
                                  "mma_ht64_qt1_bn64_w8_st2_spa_p16_tma_ss_sm90a",
                                  "mma_ht8_qt9_bn64_w8_st2_spb_p16_tr_sm90a",
                                  "flash_ht8_qt8_bn32_w8_st2_spa_sm90", "naive_w4_sm90", "naive_w4_sm120"])
def test_kernels_wait_for_the_previous_grid_before_any_global_access(name):
    """Programmatic dependent launch: sm_90+ kernels that do not prefetch (balanced splits, the
    seesaw, the transposed tile, the scalar families) let the next grid be scheduled (PREEXIT,
    griddepcontrol.launch_dependents) and wait for the previous grid (ACQBULK,
    griddepcontrol.wait) before their first global access; a later wait would let a launch
    read inputs the kernel before it is still writing."""
    _needs_nvdisasm()
    lines = _main_sass(name).splitlines()
    def first(pattern: re.Pattern) -> int:
        return next(i for i, line in enumerate(lines) if pattern.search(line))

    assert first(re.compile(r"\bPREEXIT\b")) < first(re.compile(r"\bACQBULK\b")) < first(GLOBAL_ACCESS)


@pytest.mark.parametrize("name", ["mma_ht64_qt1_bn64_w8_st1_sp5_cl_px_sm90a", WGMMA,
                                  "mma_ht64_qt1_bn64_w8_st2_sp4_cl_sm90a", "mma_ht8_qt3_bn32_w4_st2_spa_sm90",
                                  "mma_ht64_qt1_bn64_w8_st2_spa_p16_tma_sm90a"])
def test_kernels_only_prefetch_before_the_previous_grid_is_done(name):
    """The P exchange and the lockstep mma kernels of a fixed or adaptive split prefetch their Q rows and
    first KV tile into L2 between PREEXIT and ACQBULK. The length and page ids they read for
    that may be stale, so they must bypass L1 (LDG.STRONG.GPU, no line left to hit after the
    wait), and nothing before the wait may copy into shared memory or write global memory."""
    _needs_nvdisasm()
    lines = _main_sass(name).splitlines()
    wait = next(i for i, line in enumerate(lines) if re.search(r"\bACQBULK\b", line))
    assert next(i for i, line in enumerate(lines) if re.search(r"\bPREEXIT\b", line)) < wait
    before = [line for line in lines[:wait] if GLOBAL_ACCESS.search(line) or "CCTL" in line]
    assert any("CCTL.E.PF2" in line for line in before)
    assert all("CCTL.E.PF2" in line or "LDG.E.STRONG.GPU" in line for line in before), before
    assert any(re.search(r"\bLDG\.E\b(?!\.STRONG)", line) for line in lines[wait:])   # read again after it


def test_kernels_for_older_archs_have_no_dependent_launch_control():
    _needs_nvdisasm()
    text = _main_sass("naive_w4_sm80")
    assert "ACQBULK" not in text and "PREEXIT" not in text


@pytest.mark.parametrize("name,heads", [pytest.param("mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a", 16, marks=MATRIX),
                                        ("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a", 64),
                                        pytest.param("mma_ht64_qt1_bn64_w8_st2_spb_tma_ss_sm90a", 64, marks=MATRIX),
                                        ("mma_ht32_qt2_bn64_w8_st2_spb_tma_ss_sm90a", 128)])
def test_balanced_seesaw_tile_loop_lies_in_the_kernels_first_64_kb(name, heads):
    """The balanced seesaw kernels' merge blocks run their code after the tile loop, so ptxas lays
    it out there: with their code placed before it, the loop ends 4-10 KB past the kernel's first
    64 KB, and the H200 stalled on instruction fetch when the loop sat there."""
    _needs_nvdisasm()
    b = build(Problem(heads=heads), parse_variant(name))
    start, end = sass.tile_loop(sass.disassemble(b.module.cubin, b.plan.main_kernel, b.plan.arch.name))
    assert end - start > 30 * 1024 and end <= 64 * 1024   # the seesaw's pair loop, inside 64 KB


def test_tile_loop_is_the_narrowest_loop_around_the_matrix_instructions():
    text = """/*0000*/ MOV R1, c[0x0][0x28] ;
/*0010*/ HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
/*0020*/ HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
/*0030*/ @P0 BRA 0x10 ;
/*0040*/ HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
/*0050*/ BRA 0x0 ;
/*0060*/ EXIT ;
"""
    assert [op for _, op, _ in sass.instructions(text)][:2] == ["MOV", "HGMMA.64x64x16.F32.BF16"]
    assert sass.tile_loop(text) == (0x0, 0x60)   # the inner loop holds two of three: not nine tenths
    inner_only = text.replace("/*0040*/ HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;", "/*0040*/ NOP ;")
    assert sass.tile_loop(inner_only) == (0x10, 0x40)
    assert sass.tile_loop("/*0000*/ EXIT ;\n") is None


def test_seesaw_tile_loop_is_found_in_real_sass():
    """benchmarks/hot_loop.py's reading of a compiled kernel: the balanced seesaw's pair loop
    (~40 KB, holding the HGMMAs), not a wider loop around it."""
    _needs_nvdisasm()
    start, end = sass.tile_loop(_main_sass("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a"))
    assert 30 * 1024 < end - start < 50 * 1024


def test_mma_sync_kernel_has_no_wgmma():
    _needs_nvdisasm()
    counts = sass.opcodes(_main_sass("mma_ht8_qt3_bn32_w4_st2_spa_sm90"))
    assert counts["HMMA"] > 0 and counts["HGMMA"] == 0


def test_show_prints_sass_and_opcodes():
    _needs_nvdisasm()
    listing = runner.invoke(app, ["show", "naive_w4_sm90", "--sass"])
    assert listing.exit_code == 0, listing.output
    assert re.search(r"/\*0000\*/\s+\w", listing.output)
    table = runner.invoke(app, ["show", WGMMA, "--opcodes"])
    assert table.exit_code == 0, table.output
    # (the title wraps to the table's width at 80 columns)
    assert "HGMMA" in table.output and re.search(r"\d+ instructions\s+\(static\)", table.output)


def test_show_without_nvdisasm_says_how_to_get_it(monkeypatch, tmp_path):
    missing = str(tmp_path / "no-nvdisasm")
    monkeypatch.setenv("MLAGEN_NVDISASM", missing)
    monkeypatch.setattr(sass, "wheel_dirs", lambda *subs: [])
    monkeypatch.setattr(sass.shutil, "which", lambda name: None)
    result = runner.invoke(app, ["show", "naive_w4_sm90", "--opcodes"])
    assert result.exit_code != 0
    assert "pip install nvidia-cuda-nvdisasm" in result.output and missing in result.output


# The split kernels benchmarks/trace_blocks.py stamps, and how many stamps each gets (its TR
# macro's definition among them).
BLOCK_TRACES = [
    ("mma_ht64_qt1_bn64_w8_st1_spa_pvm_sm90a", 11), ("mma_ht32_qt2_bn64_w8_st2_spa_sm90a", 11),
    ("mma_ht32_qt2_bn64_w8_st2_spa_p16_sm90a", 15),   # rows staged and written, a pair's merge done
    ("mma_ht32_qt2_bn64_w8_st2_spa_p16_tma_sm90a", 15),
    ("mma_ht64_qt1_bn64_w8_st2_sp4_cl_sm90a", 9),     # (split_merge_blocks.cuh.j2's merge wait, which it never runs)
    # the seesaw: 16-bit rows: a pair's merge done, rows staged and written (4 more); its source also
    # holds the TMA pipeline's tile-0 stamp, in the acquire only the lockstep loop calls
    ("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a", 16),
    ("mma_ht8_qt9_bn64_w8_st2_spb_p16_tma_tr_sm90a", 14),   # rows staged, stores issued
]
# compiled traced by default: the largest kernels, where a stamp is likeliest to cost a spill
TRANSPOSED_TRACE = "mma_ht8_qt9_bn64_w8_st2_spb_p16_tma_tr_sm90a"
BLOCK_TRACES_COMPILED = ("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a", TRANSPOSED_TRACE)
TRACE_DEFINES = re.compile(r"^#define MLAGEN_TRACE_\w+ (.*)$", re.MULTILINE)   # a traced point's code


def _block_trace(name: str, stamps: int, **options) -> str:
    plan = _plan(name)
    source = _benchmark("trace_blocks").block_trace(plan, render(plan), **options)
    assert source.count("TR(") == stamps
    # its definition, the segment's entry, and with TMA Q's landing (not the transposed tile's:
    # its Q and first tile share one wait)
    assert source.count("TR_FIRST(") == (3 if plan.tma and plan.variant.schedule != "transposed" else 2)
    return source


@pytest.mark.parametrize("name,stamps", BLOCK_TRACES)
def test_block_trace_stamps_every_point(name, stamps):
    """benchmarks/trace_blocks.py stamps at the trace points of each split kernel (the seesaw's
    tile loop has no tile_landed point; the TMA loop's is its wait; the transposed tile's is its
    warpgroup barrier)."""
    _block_trace(name, stamps)


@pytest.mark.parametrize("name,stamps", [pytest.param(*c, marks=() if c[0] in BLOCK_TRACES_COMPILED else MATRIX)
                                         for c in BLOCK_TRACES])
def test_block_trace_compiles_for_the_split_kernels(name, stamps):
    """The traced sm_90a kernels compile, without spills where the kernel has none."""
    plan = _plan(name)
    module = compile_source(_block_trace(name, stamps), plan.name, plan.arch.name)
    # (the 72-row transposed tile runs at 255 registers and spills a little without stamps too)
    assert plan.variant.transposed or all(not r.spills for r in module.resources.values())


def test_block_trace_stamps_from_globaltimer_alone():
    """globaltimer_only: every stamp reads the global timer (no clock64), and the kernel compiles."""
    plan = _plan(TRANSPOSED_TRACE)
    timed = _block_trace(TRANSPOSED_TRACE, dict(BLOCK_TRACES)[TRANSPOSED_TRACE], globaltimer_only=True)
    assert "clock64()" not in timed and "tr_gt()" in timed
    assert compile_source(timed, plan.name, plan.arch.name).cubin[:4] == b"\x7fELF"


def test_exchange_trace_compiles():
    """benchmarks/trace_exchange.py stamps the P exchange's phases at the trace points of its
    template: every one is there, and the traced kernel compiles without spills."""
    trace_exchange = _benchmark("trace_exchange")
    plan = _plan("mma_ht64_qt1_bn64_w8_st1_sp8_cl_px_sm90a")
    source = trace_exchange.exchange_trace(plan, render(plan))
    assert source.count("TR(") == len(trace_exchange.EXCHANGE_POINTS) + 1     # the macro's own definition
    module = compile_source(source, plan.name, plan.arch.name)
    assert all(not r.spills for r in module.resources.values())


def test_seesaw_trace_compiles():
    """benchmarks/trace_seesaw.py stamps each step of both warpgroups at the trace points of the
    seesaw loop: every one is there, and the traced kernel compiles without spills or serialized
    wgmmas (a stamp that cost either would distort what it measures)."""
    trace_seesaw, trace_blocks = _benchmark("trace_seesaw"), _benchmark("trace_blocks")
    plan = _plan("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a")
    seesaw = trace_seesaw.SEESAW
    source = trace_seesaw.paired_trace(plan, render(plan))
    codes = TRACE_DEFINES.findall(source)
    assert sum(code.startswith("TS(") for code in codes) == len(seesaw.steps) == 15
    assert sum(code.startswith("TB(") for code in codes) == len(seesaw.boundary) == 5   # a segment boundary's steps
    module = compile_source(source, plan.name, plan.arch.name)
    assert all(not r.spills and r.stack_frame == 0 for r in module.resources.values()), module.resources
    assert "C751" not in module.log and "serialized" not in module.log, module.log
    assert sum("GT()" in code for code in codes) == 1      # the global timer, once a pair
    with pytest.raises(SystemExit, match="trace points not in the kernel"):
        trace_blocks.traced(render(_plan(WGMMA)), seesaw.header(), seesaw.points(), tuple(seesaw.points()))


@pytest.mark.parametrize("name", ["mma_ht8_qt9_bn64_w8_st2_spb_p16_tr_sm90a", "mma_ht8_qt4_bn64_w8_st2_sp3_tr_sm90a"])
def test_transposed_trace_compiles(name):
    """trace_seesaw.py's transposed schedule: every trace point of templates/mma_transposed.cu.j2
    is there, the stamps go into every step of both warpgroups (the scores and softmax through
    `me`), a pair counter carries the pairs across a balanced range's segments, and the traced
    kernel keeps its wgmmas asynchronous and its stack within what the tile is allowed."""
    trace_seesaw = _benchmark("trace_seesaw")
    plan = _plan(name, heads=8)
    tr = trace_seesaw.TRANSPOSED
    assert trace_seesaw.schedule_of(plan.variant) is tr
    source = trace_seesaw.paired_trace(plan, render(plan))
    codes = TRACE_DEFINES.findall(source)
    assert sum(code.startswith("TS(") for code in codes) == len(tr.steps)
    assert sum(code.startswith("TS(me, ") for code in codes) == sum(w is None for (w, _), _, _ in tr.steps) >= 6
    assert sum(code.startswith("TB(") for code in codes) == len(tr.boundary)
    assert sum("if (me == 0) GT()" in code for code in codes) == 1
    assert [c for c in codes if c.endswith("mlagen_ss_pairs[2 * SS_BLOCK + me] = 0")]
    assert [c for c in codes if c.endswith("mlagen_ss_pairs[2 * SS_BLOCK + me] += pairs")]
    slots = [slot for w in (0, 1) for slot, _ in tr.sequence(w)] + [tr.global_slot]
    slots += [tr.boundary_slot + k for k in range(len(tr.boundary))]
    assert len(set(slots)) == len(slots) and max(slots) < tr.events      # no two stamps share a slot
    module = compile_source(source, plan.name, plan.arch.name)
    assert all(r.stack_frame <= TRANSPOSED_STACK for r in module.resources.values()), module.resources
    assert "C751" not in module.log and "serialized" not in module.log, module.log


def test_seesaw_trace_phases_are_clock_deltas_at_the_measured_rate():
    """trace_seesaw.phases: per inner pair, each warpgroup's step-to-step cycles at `ghz` as µs,
    and the pair period; the first and last pairs (prologue, tail) are left out."""
    trace_seesaw = _benchmark("trace_seesaw")

    def pair(start: int) -> list[int]:
        stamps = [0] * trace_seesaw.SEESAW.events
        for e in range(7):
            stamps[e] = start + 100 * e                   # warpgroup 0: a step every 100 cycles
        for e in range(8):
            stamps[8 + e] = start + 50 + 200 * e          # warpgroup 1: every 200
        return stamps

    got = trace_seesaw.phases([pair(0), pair(4000), pair(8000), pair(12000)], 2.0, trace_seesaw.SEESAW)
    assert len(got["pair period (wg0 K0 landed to the next)"]) == 2
    assert got["pair period (wg0 K0 landed to the next)"] == [2.0, 2.0]        # 4000 cycles at 2 GHz
    first, second = (label for _, _, label in trace_seesaw.SEESAW.steps[:2])    # warpgroup 0's first two steps
    assert got[f"wg0: {first} -> {second}"] == [0.05, 0.05]
    assert all(v == [0.1, 0.1] for k, v in got.items() if k.startswith("wg1"))
    assert got["wg0: P1 V1_L done -> next K0 landed"] == [(4000 - 600) / 2000] * 2


def test_seesaw_trace_boundaries_follow_a_segment_end_to_the_next_k0():
    """trace_seesaw.boundaries: for a pair with boundary stamps (a segment's last pair), the µs
    from warpgroup 0's last P1 V1_L through each epilogue step to the next pair's K0; pairs
    without them (inside a segment) and a block's last pair give nothing."""
    trace_seesaw = _benchmark("trace_seesaw")

    seesaw = trace_seesaw.SEESAW

    def pair(start: int, boundary: bool) -> list[int]:
        stamps = [0] * seesaw.events
        stamps[0], stamps[6] = start, start + 600
        if boundary:
            for k in range(len(seesaw.boundary)):
                stamps[seesaw.boundary_slot + k] = start + 1000 + 200 * k       # a step every 200 cycles
        return stamps

    got = trace_seesaw.boundaries([pair(0, False), pair(4000, True), pair(9000, False), pair(12000, True)], 2.0,
                                  seesaw)
    assert got["boundary in all (P1 V1_L done -> next K0 landed)"] == [(9000 - 4600) / 2000]
    steps = [k for k in got if k != "boundary in all (P1 V1_L done -> next K0 landed)"]
    assert len(steps) == len(seesaw.boundary) + 1
    assert got[steps[0]] == [0.2] and all(got[k] == [0.1] for k in steps[1:-1])   # 400, then 200 cycles
    assert got[steps[-1]] == [(9000 - 5800) / 2000]


@pytest.mark.parametrize("name,heads", [("mma_ht8_qt9_bn64_w8_st2_spb_p16_tr_sm90a", 8),
                                        ("mma_ht8_qt9_bn64_w8_st2_spb_tr_sm90a", 8),
                                        pytest.param("mma_ht8_qt5_bn64_w8_st2_sp3_p16_tr_sm90a", 8, marks=MATRIX),
                                        pytest.param("mma_ht16_qt1_bn64_w8_st2_spb_p16_tr_sm90a", 16, marks=MATRIX)])
def test_transposed_tile_stores_its_fragments_by_stmatrix(name, heads):
    """P^T (8 columns x 8 keys a fragment) and, with part16, the staged output rows (8 columns x 8
    dims, 4 value blocks a thread) go out as stmatrix.trans, two 8-column groups an
    instruction: ceil(N/16) a tile, and 4 times that in the epilogue. fp32 rows stay scalar."""
    _needs_nvdisasm()
    v = parse_variant(name)
    b = build(Problem(heads=heads), v)
    code = sass.disassemble(b.module.cubin, b.plan.main_kernel, b.plan.arch.name)
    groups = -(-v.q_tile * v.head_tile // 16)
    assert code.count("STSM") == groups * (5 if v.partials == "16bit" else 1)


@pytest.mark.parametrize("name,heads", [("mma_ht8_qt9_bn64_w8_st2_spb_p16_tr_sm90a", 8),
                                        ("mma_ht16_qt2_bn64_w8_st2_spa_tr_sm90a", 16),
                                        pytest.param("mma_ht8_qt9_bn64_w8_st2_spb_p16_tma_tr_sm90a", 8, marks=MATRIX)])
def test_transposed_kernel_issues_each_product_without_waits(name, heads):
    """The transposed tile's 36 score wgmmas, and each output product's 16, go out back to back:
    ptxas's log says nothing when it makes a wgmma wait for the one before, so the SASS is read.
    Its waits: one per product and the loop's few."""
    _needs_nvdisasm()
    b = build(Problem(heads=heads, mask="tree"), parse_variant(name))
    code = sass.disassemble(b.module.cubin, b.plan.main_kernel, b.plan.arch.name)
    marks = "".join("w" if "WARPGROUP.DEPBAR" in line else "h" for line in code.splitlines()
                    if "HGMMA" in line or "WARPGROUP.DEPBAR" in line)
    runs = [len(r) for r in marks.split("w") if r]
    assert max(runs) >= 36 and runs.count(16) >= 2, marks
    assert marks.count("w") <= 8, marks
