"""`mlagen fuzz`: the shapes it draws, how it judges a kernel (with stand-in kernels on the CPU),
its options; on a GPU, a short run of the real thing."""

import dataclasses
import math
import re

import pytest
import torch
from gpu_checks import require_target
from typer.testing import CliRunner

from cli import app
from mlagen.dispatch.policy import H200
from mlagen.dsl.spec import DTYPES, KV_FORMATS, MASKS, Q_FORMATS, parse_variant
from mlagen.plan.schedules import SCHEDULES
from mlagen.plan.validate import is_valid
from mlagen.runtime.inputs import output_dtype
from mlagen.tools.fuzz import FuzzSpace, Shape, check, draw, draw_variant, fuzz
from mlagen.tools.testing import Case

runner = CliRunner()
SMALL = FuzzSpace(heads=(8, 16), max_batch=3, max_seqlen_q=9, max_prefix=300, page_sizes=(16, 64))


def test_a_seed_always_draws_the_same_shape_within_the_space():
    space = FuzzSpace()
    shapes = [draw(seed, space) for seed in range(400)]
    assert shapes == [draw(seed, space) for seed in range(400)]
    for s in shapes:
        assert 1 <= s.batch <= space.max_batch and len(s.prefixes) == len(s.empty) == s.batch
        assert 1 <= s.seqlen_q <= space.max_seqlen_q and s.heads in space.heads
        assert all(0 <= p <= space.max_prefix for p in s.prefixes)
        assert s.batch * s.seqlen_q * s.heads * (max(s.prefixes) + s.seqlen_q) <= space.max_work
        assert s.per_request_tree <= (s.mask == "tree")
    # what the kernels' corner cases need shows up within a few hundred seeds
    assert {s.mask for s in shapes} == set(MASKS) and {s.dtype for s in shapes} == set(DTYPES)
    assert {s.page_size for s in shapes} == set(space.page_sizes) and {s.heads for s in shapes} == set(space.heads)
    assert any(any(s.empty) and not all(s.empty) for s in shapes)
    assert any(s.seqlen_q > 16 for s in shapes) and any(s.seqlen_q == 1 for s in shapes)
    assert any(s.per_request_tree for s in shapes) and {s.lse for s in shapes} == {False, True}
    assert any((p + s.seqlen_q) % 64 in (63, 0, 1) and p > 0 for s in shapes for p in s.prefixes)
    assert any(max(s.prefixes) > 5000 for s in shapes) and any(max(s.prefixes) == 0 for s in shapes)
    assert len({s.prefixes for s in shapes if s.batch > 1 and len(set(s.prefixes)) > 1}) > 50   # ragged
    longest = [max(0 if e else p + s.seqlen_q for p, e in zip(s.prefixes, s.empty, strict=True)) for s in shapes]
    bounds = [(s.max_seqlen_k, n) for s, n in zip(shapes, longest, strict=True)]
    assert any(b is None for b, _ in bounds) and any(b == n > 0 for b, n in bounds)
    assert any(b is not None and b < n for b, n in bounds) and all(b is None or b <= n for b, n in bounds)
    assert any(s.table_pages * s.page_size >= 32768 for s in shapes) and any(not s.table_pages for s in shapes)


def test_kv_formats_are_drawn_last_and_run_the_kernels_that_read_them():
    """With --kv a seed keeps its 16-bit shape and draws its cache's format after it; every format
    shows up, and an FP8 shape's random variant is the naive kernel, an mma lockstep tile with
    cp.async loads or, over an e4m3 cache, the fp8_ws schedule's tile, over a ds_mla one the fp8_ldg
    schedule's, all among the draws."""
    fp8 = FuzzSpace(kv_formats=KV_FORMATS)
    shapes = [draw(seed, fp8) for seed in range(60)]
    assert [dataclasses.replace(s, kv_format="dtype") for s in shapes] == [draw(seed) for seed in range(60)]
    assert {s.kv_format for s in shapes} == set(KV_FORMATS)
    assert all(s.kv_format == "dtype" for s in map(draw, range(60)))
    families = set()
    for s in shapes:
        v = draw_variant(s, "sm_90")
        assert v is not None and is_valid(s.problem, v) and (s.problem.kv_format == s.kv_format)
        if s.kv_format != "dtype":
            families.add(v.family)
            assert v.family == "naive" or (v.family, v.schedule, v.loads) in {("mma", "lockstep", "cp_async"),
                                                                             ("mma", "fp8_ws", "tma"),
                                                                             ("mma", "fp8_ldg", "cp_async")}
    assert families == {"naive", "mma"}
    drawn = [(s, draw_variant(s, "sm_90")) for s in (draw(seed, fp8) for seed in range(600))]
    ws = [v for _, v in drawn if v.schedule == "fp8_ws"]
    assert ws and all(v.loads == "tma" and v.arch == "sm_90a" for v in ws)
    ldg = [(s, v) for s, v in drawn if v.schedule == "fp8_ldg"]
    assert ldg and all(s.kv_format == "ds_mla" and v.arch == "sm_90a" for s, v in ldg)
    assert "kv ds_mla" in str(next(s for s in shapes if s.kv_format == "ds_mla"))


def test_a_correct_kernel_passes_fp8_shapes():
    """The fuzz loop on FP8 caches (quantized by make_case, the reference on their rows)."""
    space = dataclasses.replace(SMALL, kv_formats=("e4m3", "ds_mla"))
    report = fuzz(range(8), [None], space, device="cpu", kernel=_reference_kernel)
    assert [o.status for o in report.outcomes] == ["ok"] * 8
    assert {o.shape.kv_format for o in report.outcomes} == {"e4m3", "ds_mla"}


def test_query_formats_are_drawn_after_the_cache_format():
    """With --q a seed keeps its shape and cache format and draws its queries' format last; e4m3
    queries write bf16 over an FP8 cache and their dtype over a 16-bit one, and run the naive
    kernel but over an e4m3 cache on sm_90a, where the fp8_mma schedule reads them too."""
    both = FuzzSpace(kv_formats=KV_FORMATS, q_formats=Q_FORMATS)
    shapes = [draw(seed, both) for seed in range(60)]
    kv_only = [draw(seed, FuzzSpace(kv_formats=KV_FORMATS)) for seed in range(60)]
    assert [dataclasses.replace(s, q_format="dtype") for s in shapes] == kv_only
    assert {(s.kv_format != "dtype", s.q_format) for s in shapes} == {(False, "dtype"), (False, "e4m3"),
                                                                       (True, "dtype"), (True, "e4m3")}
    for s in shapes:
        assert s.problem.q_format == s.q_format
        if s.q_format == "e4m3":
            assert s.problem.dtype == ("bf16" if s.kv_format != "dtype" else s.dtype) and " q e4m3" in str(s)
            v = draw_variant(s, "sm_90")
            assert v.family == "naive" or (v.schedule == "fp8_mma" and s.kv_format == "e4m3"), v.name


def test_a_correct_kernel_passes_e4m3_query_shapes():
    """The fuzz loop on e4m3 queries (make_case quantizes them with a q_scale, the reference reads
    them dequantized), over 16-bit and FP8 caches."""
    space = dataclasses.replace(SMALL, kv_formats=("dtype", "e4m3"), q_formats=("e4m3",))
    report = fuzz(range(8), [None], space, device="cpu", kernel=_reference_kernel)
    assert [o.status for o in report.outcomes] == ["ok"] * 8
    case = report.outcomes[0].shape.case("cpu")
    assert case.q.dtype == torch.float8_e4m3fn and case.kwargs()["q_scale"] is case.q_scale


def test_gathered_keys_are_drawn_last_with_their_own_slots():
    """With --keys a seed keeps its shape's batch, drafts, heads, page size and formats and then
    draws gathered keys: no mask, a topk within the work bound, each request's slot count (0
    where it is empty); its random variants are the naive kernel or one-token lockstep tiles."""
    both = dataclasses.replace(SMALL, keys=("paged", "gathered"), kv_formats=KV_FORMATS)
    shapes = [draw(seed, both) for seed in range(60)]
    paged = [draw(seed, dataclasses.replace(SMALL, kv_formats=KV_FORMATS)) for seed in range(60)]
    gathered = [s for s in shapes if s.keys == "gathered"]
    assert gathered and len(gathered) < len(shapes)
    for s, p in zip(shapes, paged, strict=True):
        assert (s.batch, s.seqlen_q, s.heads, s.page_size, s.kv_format, s.dtype) == (
            p.batch, p.seqlen_q, p.heads, p.page_size, p.kv_format, p.dtype)
        if s.keys == "paged":
            assert s == p
    for s in gathered:
        assert s.problem.gathered and s.mask == "none" and s.kv_capacity == s.topk
        assert len(s.topk_lengths) == s.batch and all(0 <= n <= s.topk for n in s.topk_lengths)
        assert all(n == 0 for n, e in zip(s.topk_lengths, s.empty, strict=True) if e)
        assert "gathered topk=" in str(s)
        v = draw_variant(s, "sm_90")
        assert v.family == "naive" or (v.q_tile == 1 and v.schedule == "lockstep" and v.loads == "cp_async"), v.name


def test_a_correct_kernel_passes_gathered_shapes():
    """The fuzz loop on gathered keys: make_sparse_case's inputs, the sparse reference."""
    space = dataclasses.replace(SMALL, keys=("gathered",), kv_formats=("dtype", "ds_mla"))
    report = fuzz(range(8), [None], space, device="cpu", kernel=_reference_kernel)
    assert [o.status for o in report.outcomes] == ["ok"] * 8
    assert report.outcomes[0].shape.case("cpu").indices.dtype == torch.int32


def test_a_narrow_space_is_kept():
    shapes = [draw(seed, SMALL) for seed in range(100)]
    assert {s.heads for s in shapes} <= {8, 16} and {s.page_size for s in shapes} <= {16, 64}
    assert max(s.seqlen_q for s in shapes) <= 9 and max(max(s.prefixes) for s in shapes) <= 300


def test_a_random_variant_is_valid_for_its_shape_and_reaches_every_knob():
    shapes = [draw(seed) for seed in range(300)]
    hopper = [draw_variant(s, "sm_90") for s in shapes]
    assert hopper == [draw_variant(s, "sm_90") for s in shapes]
    assert all(v is not None and is_valid(s.problem, v) for s, v in zip(shapes, hopper, strict=True))
    assert {v.family for v in hopper} == {"naive", "flash", "mma"} and {v.arch for v in hopper} == {"sm_90", "sm_90a"}
    for field, value in (("loads", "tma"), ("combine", "cluster"), ("partials", "16bit"), ("mma_pv", True),
                         *(("schedule", s.name) for s in SCHEDULES.values() if s.reads("dtype"))):
        assert any(getattr(v, field) == value for v in hopper), (field, value)
    assert any(v.transposed and v.loads == "tma" for v in hopper)
    assert any(v.kv_split == "balanced" for v in hopper) and any(v.kv_split == "adaptive" for v in hopper)
    ampere = [draw_variant(s, "sm_80") for s in shapes[:100]]
    assert {v.arch for v in ampere} == {"sm_80"}
    assert all(is_valid(s.problem, v) for s, v in zip(shapes[:100], ampere, strict=True))


def test_any_variant_adds_a_random_variant_to_every_shape():
    report = fuzz(range(6), [None], SMALL, any_variant="sm_90", device="cpu", kernel=_reference_kernel)
    assert [o.variant == "dispatch" for o in report.outcomes] == [True, False] * 6
    assert all(o.status == "ok" for o in report.outcomes)
    assert [o.variant for o in report.outcomes[1::2]] == [draw_variant(draw(i, SMALL), "sm_90").name for i in range(6)]
    assert all(o.drawn for o in report.outcomes[1::2]) and not any(o.drawn for o in report.outcomes[::2])
    assert (report.count("ok", "random variants"), report.count("ok", "dispatch")) == (6, 6)


@pytest.mark.parametrize("field,value,expected", [
    ("page_sizes", (3,), "powers of two"), ("masks", ("causal", "diagonal"), "some of causal"),
    ("dtypes", ("fp8",), "some of bf16"), ("heads", (), "head counts"), ("max_batch", 0, ">= 1"),
])
def test_a_bad_space_names_its_field(field, value, expected):
    with pytest.raises(ValueError, match=f"^{field}: got .*expected {expected}"):
        FuzzSpace(**{field: value})


def _reference_kernel(case, shape, variant):
    out, lse = case.reference(torch.float64)
    return out.to(output_dtype(case.q.dtype, case.kv_cache.dtype)), (lse.float() if shape.lse else None)


def _leaves_a_row_unwritten(case, shape, variant):
    out, lse = _reference_kernel(case, shape, variant)
    out[0, 0, 0, :] = math.nan
    return out, lse


def _shifts_one_value(case, shape, variant):
    out, lse = _reference_kernel(case, shape, variant)
    out[0, -1, -1, 0] += 100.0
    return out, lse


def _scales_one_row(case, shape, variant):
    out, lse = _reference_kernel(case, shape, variant)
    out[0, -1, -1] *= 1.05
    return out, lse


def _raises(case, shape, variant):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _nonempty(seed_from: int = 0) -> Shape:
    """The first SMALL shape from seed_from on whose first request has keys."""
    shapes = (draw(i, SMALL) for i in range(seed_from, seed_from + 100))
    return next(s for s in shapes if not s.empty[0] and s.mask != "tree")


def test_a_correct_kernel_passes_every_shape():
    report = fuzz(range(12), [None], SMALL, device="cpu", kernel=_reference_kernel)
    assert [o.status for o in report.outcomes] == ["ok"] * 12 and report.stopped is None


@pytest.mark.parametrize("kernel,message", [
    (_leaves_a_row_unwritten, "out: 1 of {rows} rows fail; worst (b=0, i=0, h=0): unwritten or NaN"),
    (_shifts_one_value, "out: 1 of {rows} rows fail; worst (b=0, i={last_i}, h={last_h}): relative error"),
    (_scales_one_row, "out: 1 of {rows} rows fail; worst (b=0, i={last_i}, h={last_h}): relative error 0.05"),
    (_raises, "RuntimeError: CUDA error")])
def test_a_wrong_kernel_fails_with_what_went_wrong(kernel, message):
    shape = _nonempty()
    outcome = check(shape, None, device="cpu", kernel=kernel)
    rows = shape.batch * shape.seqlen_q * shape.heads
    message = message.format(rows=rows, last_i=shape.seqlen_q - 1, last_h=shape.heads - 1)
    assert outcome.status == "fail" and outcome.message.startswith(message), outcome.message
    assert outcome.variant == "dispatch"


def test_the_report_counts_shapes_and_time():
    report = fuzz(range(10), [None], SMALL, device="cpu", kernel=_reference_kernel)
    assert report.shapes == 10 and report.elapsed_s > 0
    assert report.shapes_per_s == pytest.approx(10 / report.elapsed_s)
    assert re.fullmatch(r"10 shapes in \d+\.\d s \(\d+\.\d shapes/s\), 0 failed", report.summary()), report.summary()
    failing = fuzz(range(4), [None], SMALL, device="cpu", kernel=_raises, alive=lambda: True)
    assert failing.summary().endswith(", 4 failed") and failing.shapes == 4
    # A shape that every variant skips is not counted as checked.
    skipped = fuzz(range(3), [parse_variant("mma_ht16_qt4_bn64_w8_st2_spa_sm90")],
                   FuzzSpace(heads=(8,), max_batch=2, max_prefix=100), device="cpu", kernel=_reference_kernel)
    assert skipped.count("skip") == 3 and skipped.shapes == 0 and skipped.summary().startswith("0 shapes in")


def test_a_shapes_checks_share_one_case_and_one_reference(monkeypatch):
    """The dispatcher's pick and a random variant on each shape: one case built per shape, its fp64
    reference computed once, before the first kernel ran."""
    built, computed, seen = [], [], []
    case_of, reference_of = Shape.case, Case.reference

    def counted_case(self, device="cuda"):
        built.append(self.seed)
        return case_of(self, device)

    def counted_reference(self, dtype=torch.float32):
        computed.append(len(seen))
        return reference_of(self, dtype)

    def kernel(case, shape, variant):
        seen.append(id(case))
        return _reference_kernel(case, shape, variant)

    monkeypatch.setattr(Shape, "case", counted_case)
    monkeypatch.setattr(Case, "reference", counted_reference)
    report = fuzz(range(5), [None], SMALL, any_variant="sm_90", device="cpu", kernel=kernel)
    assert report.count("ok") == 10 and report.shapes == 5 and built == list(range(5))
    assert seen[0::2] == seen[1::2]                      # both kernels of a shape got the same case
    # One reference per shape for the comparison, computed before the shape's kernels ran (the
    # kernel here computes its own besides, once per run).
    assert computed[0::3] == [0, 2, 4, 6, 8]


def test_a_variant_that_does_not_fit_the_shape_is_skipped_without_running():
    shape = next(s for s in (draw(i, SMALL) for i in range(100)) if s.heads == 8)
    variant = parse_variant("mma_ht16_qt4_bn64_w8_st2_spa_sm90")      # 16 heads a block, the shape has 8

    def must_not_run(case, shape, variant):
        raise AssertionError("ran")
    outcome = check(shape, variant, device="cpu", kernel=must_not_run)
    assert outcome.status == "skip" and "head_tile" in outcome.message


def test_a_lost_cuda_context_stops_the_run_at_that_seed():
    first = _nonempty().seed
    report = fuzz(range(first, first + 5), [None], SMALL, device="cpu", kernel=_raises, alive=lambda: False)
    assert len(report.outcomes) == 1 and report.stopped.startswith(f"the CUDA context was lost at seed {first}")
    survived = fuzz(range(first, first + 3), [None], SMALL, device="cpu", kernel=_raises, alive=lambda: True)
    assert [o.status for o in survived.outcomes] == ["fail"] * 3 and survived.stopped is None
    assert (survived.count("fail"), survived.count("fail", "dispatch"), survived.count("ok")) == (3, 3, 0)
    assert survived.count("fail", "mma_ht16_qt4_bn64_w8_st2_spa_sm90") == 0


@pytest.mark.parametrize("args,message", [
    (["--page-size", "48"], "--page-size: got 48, expected a power of two"),
    (["--mask", "diagonal"], "--mask: got 'diagonal', expected one of causal"),
    (["--max-seqlen-q", "0"], "--max-seqlen-q: got 0"),
    (["--cases", "0"], "--cases: got 0"),
    (["--minutes", "0"], "--minutes: got 0"),
    (["--no-dispatch"], "expected --variant or --any-variant"),
    (["--variant", "mma_bogus"], "--variant"),
    (["--kv", "fp8"], "--kv: got 'fp8', expected one of dtype, e4m3, ds_mla"),
    (["--q", "e5m2"], "--q: got 'e5m2', expected one of dtype, e4m3"),
    (["--keys", "sparse"], "--keys: got 'sparse', expected one of paged, gathered"),
])
def test_fuzz_options_fail_before_any_gpu_work(args, message):
    result = runner.invoke(app, ["fuzz", *args])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_fuzz_needs_a_gpu():
    result = runner.invoke(app, ["fuzz", "--cases", "1"])
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output


@pytest.mark.gpu
def test_fuzz_runs_clean_on_this_gpu():
    """A short run of the real thing: the dispatcher's pick and a fixed-split mma variant on
    every shape, each shape compared with the reference."""
    name = "mma_ht8_qt4_bn64_w4_st2_sp3_sm90"
    report = fuzz(range(8), [None, parse_variant(name)], FuzzSpace(max_prefix=3000))
    assert report.stopped is None and len(report.outcomes) == 16
    assert report.count("ok", "dispatch") == 8, [o.message for o in report.outcomes if o.status != "ok"]
    assert report.count("fail", name) == 0 and report.count("ok", name) >= 1
    assert report.shapes == 8 and report.summary().startswith("8 shapes in")


@pytest.mark.gpu
def test_fuzz_runs_clean_on_fp8_caches():
    """FP8 caches of both layouts through the dispatcher's pick (the naive kernel)."""
    report = fuzz(range(8), [None], FuzzSpace(max_prefix=2000, kv_formats=("e4m3", "ds_mla")))
    assert report.count("ok", "dispatch") == 8, [o.message for o in report.outcomes if o.status != "ok"]


@pytest.mark.gpu
def test_fuzz_random_variants_run_clean_on_fp8_caches():
    """Random variants for FP8 caches (the naive kernel and the mma tiles that stage FP8 rows),
    each shape against the reference; both families among them."""
    report = fuzz(range(24), [], FuzzSpace(max_prefix=3000, kv_formats=("e4m3", "ds_mla")), any_variant="sm_90")
    assert report.count("fail") == 0, [o.message for o in report.failures]
    drawn = [o for o in report.outcomes if o.status == "ok"]
    assert {o.variant.split("_")[0] for o in drawn} == {"naive", "mma"}


@pytest.mark.gpu
def test_fuzz_runs_clean_on_e4m3_queries():
    """e4m3 queries over 16-bit and FP8 caches through the dispatcher's pick."""
    report = fuzz(range(8), [None], FuzzSpace(max_prefix=2000, kv_formats=KV_FORMATS, q_formats=("e4m3",)))
    assert report.count("ok", "dispatch") == 8, [o.message for o in report.outcomes if o.status != "ok"]


@pytest.mark.gpu
def test_fuzz_random_variants_run_clean_on_e4m3_queries():
    """Random variants for e4m3 queries over an e4m3 cache (the naive kernel and, on sm_90a with
    pages of 64 keys, the fp8_mma tiles), each shape against the reference, on a GPU that runs
    sm_90a code; fp8_mma among them."""
    require_target("sm_90a")
    space = FuzzSpace(max_prefix=3000, page_sizes=(64, 128), kv_formats=("e4m3",), q_formats=("e4m3",))
    report = fuzz(range(24), [], space, any_variant="sm_90")
    assert report.count("fail") == 0, [o.message for o in report.failures]
    drawn = {o.variant for o in report.outcomes if o.status == "ok"}
    assert drawn and any("_f8_" in v for v in drawn), sorted(drawn)


@pytest.mark.gpu
def test_fuzz_runs_clean_on_gathered_keys():
    """Gathered keys in every cache format through the dispatcher's pick and random variants."""
    space = FuzzSpace(page_sizes=(1, 16, 64), kv_formats=KV_FORMATS, keys=("gathered",))
    report = fuzz(range(16), [None], space, any_variant="sm_90")
    assert report.count("fail") == 0, [o.message for o in report.failures]
    assert report.count("ok", "dispatch") == 16


@pytest.mark.gpu
def test_fuzz_checks_the_default_space_clean_from_the_cache():
    """The default space's shapes (up to 8 requests of 20000 keys, 128 heads): a first pass
    compiles their kernels (ahead, in worker processes), the second runs them from the cache (case
    on the device, one fp64 reference per shape, the row-by-row comparison). Its rate is the
    bench's business (`mlagen fuzz` prints it), not a test's: it moves with the machine's load."""
    first = fuzz(range(40), [None])
    assert first.count("fail") == 0, [o.message for o in first.failures]
    again = fuzz(range(40), [None])
    assert again.shapes == 40 and again.count("fail") == 0 and again.count("ok") == first.count("ok")
    assert again.elapsed_s > 0 and re.fullmatch(r"40 shapes in [\d.]+ s \([\d.]+ shapes/s\), 0 failed", again.summary())


@pytest.mark.gpu
def test_fuzz_any_variant_runs_clean_on_this_gpu():
    """Random variants of the whole DSL for this GPU (they compile on first use), through the CLI:
    every seed passes and the summary counts them in one row."""
    result = runner.invoke(app, ["fuzz", "--cases", "4", "--max-prefix", "2000", "--no-dispatch", "--any-variant"])
    assert result.exit_code == 0, result.output
    assert re.search(r"random variants\s*│\s*4\s*│\s*0\s*│\s*0\s*│", result.output), result.output


class _RecordingPool:
    """Stands in for the compile workers: records what is submitted, runs nothing."""

    def __init__(self):
        self.jobs, self.closed = [], False

    def submit(self, fn, *args):
        self.jobs.append(args)

    def shutdown(self, wait=True, cancel_futures=False):
        self.closed = True


def test_kernels_are_queued_for_compiling_ahead_of_their_shapes(monkeypatch):
    """With compile workers, each shape's kernels (the dispatcher's pick for the GPU, the named
    variants that fit it, its random variant) are queued once per distinct code, while shapes
    that many places earlier still run; the pool is shut down at the end."""
    from mlagen.codegen.precompile import code_identity
    from mlagen.tools import fuzz as fuzz_module

    pool = _RecordingPool()
    monkeypatch.setattr(fuzz_module._CompileAhead, "start",
                        classmethod(lambda cls, workers, device: cls(lambda: pool, workers, "sm_90", "NVIDIA H200",
                                                                     H200)))
    named = parse_variant("mma_ht16_qt4_bn64_w8_st2_spa_sm90")          # fits the 16-head shapes only
    queued_at = []

    def kernel(case, shape, variant):
        queued_at.append((shape.seed, len(pool.jobs)))
        return _reference_kernel(case, shape, variant)

    report = fuzz(range(12), [None, named], SMALL, any_variant="sm_90", device="cpu", kernel=kernel,
                  compile_workers=2)
    assert report.count("fail") == 0 and pool.closed
    per_shape = []
    for s in (draw(i, SMALL) for i in range(12)):
        kernels = [fuzz_module.dispatched_variant(s, "sm_90", "NVIDIA H200", H200), named, draw_variant(s, "sm_90")]
        per_shape.append([code_identity(s.problem, v) for v in kernels if v is not named or s.heads == 16])
    assert pool.jobs == list(dict.fromkeys(k for ks in per_shape for k in ks))   # each distinct code once, in order
    # When seed 0 runs, the kernels of the first 8 shapes (4 per worker) are queued already.
    assert queued_at[0] == (0, len(dict.fromkeys(k for ks in per_shape[:8] for k in ks)))
    workers = fuzz_module._compile_workers
    assert workers(None, None, "cpu") == 0 and workers(None, kernel, "cuda") == 0 and workers(3, kernel, "cpu") == 3


def test_no_compile_workers_start_when_every_kernel_is_loaded(monkeypatch):
    """A run whose kernels this process has loaded already (a second pass over the same seeds)
    starts no worker pool: spawning workers costs seconds that fuzzing at 20 shapes/s cannot pay."""
    from mlagen.runtime import launch
    from mlagen.tools import fuzz as fuzz_module

    made = []
    monkeypatch.setattr(fuzz_module._CompileAhead, "start",
                        classmethod(lambda cls, workers, device: cls(lambda: made.append(1) or _RecordingPool(),
                                                                     workers, "sm_90", "NVIDIA H200", H200)))
    monkeypatch.setattr(launch, "is_loaded", lambda problem, variant, device_index: True)
    report = fuzz(range(6), [None], SMALL, device="cpu", kernel=_reference_kernel, compile_workers=2)
    assert report.count("fail") == 0 and report.count("ok") > 0 and made == []
    monkeypatch.setattr(launch, "is_loaded", lambda problem, variant, device_index: False)
    fuzz(range(6), [None], SMALL, device="cpu", kernel=_reference_kernel, compile_workers=2)
    assert made == [1]                                  # one pool, made on the first code to compile
