"""FP8 KV caches through the DSL, the plan, the dispatcher and the naive kernel: what a problem
with kv_format "e4m3" or "ds_mla" is called, which variants take it, that its kernels compile for
every arch, and (on a GPU) that the op's results match the fp64 reference of the dequantized
cache, row by row."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from gpu_checks import require_target

import mlagen
from mlagen.codegen.build import build
from mlagen.dispatch.policy import H200, batch_invariant_variant, choose_variant, fp8_tile
from mlagen.dsl import kv_layout
from mlagen.dsl.arch import ARCHS
from mlagen.dsl.errors import SpecError
from mlagen.dsl.spec import Problem, naive, parse_variant
from mlagen.plan.schedules import FP8_MMA
from mlagen.plan.validate import validate
from mlagen.runtime import context_parallel, varlen
from mlagen.tools.fuzz import FuzzSpace, draw
from mlagen.tools.testing import (
    E4M3_QUERY_TOLERANCE,
    FP8_PRODUCTS_TOLERANCE,
    compare_rows,
    make_case,
    reference_op,
    tolerance,
)

FP8 = ("e4m3", "ds_mla")


def test_fp8_problems_are_named_and_checked():
    assert Problem(kv_format="e4m3").name == "h64_dl512_dr64_bf16_kve4m3_p64_causal"
    assert Problem(kv_format="ds_mla", dtype="fp16", lse=True).name == "h64_dl512_dr64_fp16_kvds_mla_p64_causal_lse"
    assert Problem().name == "h64_dl512_dr64_bf16_p64_causal" and not Problem().fp8_kv
    with pytest.raises(SpecError, match="problem.kv_format: got 'fp8'"):
        validate(Problem(kv_format="fp8"), naive())
    with pytest.raises(SpecError, match="problem.kv_format: got 'e4m3', expected 'dtype' for dl=256 dr=64"):
        validate(Problem(kv_format="e4m3", dl=256), naive())
    with pytest.raises(SpecError, match="variant.family: got 'flash', expected 'naive' or 'mma' for "
                                        "problem.kv_format='ds_mla'"):
        validate(Problem(kv_format="ds_mla"), parse_variant("flash_ht8_qt8_bn32_w8_st2_spa_sm90"))
    for name, field in (("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a", "schedule"),
                        ("mma_ht8_qt9_bn64_w8_st2_sp2_tr_sm90a", "schedule"),
                        ("mma_ht64_qt1_bn64_w8_st1_sp5_cl_px_sm90a", "schedule"),
                        ("mma_ht8_qt8_bn64_w8_st2_sp2_tma_sm90a", "loads")):
        with pytest.raises(SpecError, match=f"variant.{field}: got '.*', expected '.*' for problem.kv_format='e4m3'"):
            validate(Problem(kv_format="e4m3"), parse_variant(name))


# The mma family's FP8 tiles: (format, variant) across the loop's kinds (wgmma scores with P.V on
# wgmma and on mma.sync, fixed, adaptive, balanced and cluster splits, 16-bit partials, one and two
# stages) and the mma.sync kernels of the other archs.
FP8_TILES = [
    ("e4m3", "mma_ht8_qt8_bn64_w8_st2_sp2_sm90a"), ("e4m3", "mma_ht64_qt1_bn64_w8_st2_spa_sm90a"),
    ("e4m3", "mma_ht8_qt8_bn64_w8_st2_spb_p16_sm90a"), ("e4m3", "mma_ht8_qt8_bn64_w8_st2_sp2_cl_sm90a"),
    ("ds_mla", "mma_ht8_qt8_bn64_w8_st1_sp2_pvm_sm90a"), ("ds_mla", "mma_ht64_qt1_bn64_w8_st1_spb_sm90a"),
    ("e4m3", "mma_ht8_qt4_bn64_w4_st2_sp3_sm90"), ("ds_mla", "mma_ht8_qt4_bn32_w4_st2_spa_sm90"),
    ("e4m3", "mma_ht8_qt4_bn32_w4_st2_sp3_sm80"), ("ds_mla", "mma_ht8_qt4_bn32_w4_st1_spb_sm89"),
    ("e4m3", "mma_ht8_qt4_bn32_w4_st1_spa_sm120"),
    # 32-key tiles of 8 warps: eight threads a row in the dequantize
    ("e4m3", "mma_ht64_qt1_bn32_w8_st3_spa_sm90"), ("ds_mla", "mma_ht64_qt1_bn32_w8_st3_spb_sm90"),
]


@pytest.mark.parametrize("fmt,name", FP8_TILES)
def test_fp8_tiles_compile_without_spills(fmt, name):
    """Each FP8 tile compiles with no spill, stages its rows (RowLoad's staged layout) and dequantizes them into
    its one 16-bit tile; its shared memory is that tile, the staged rows rounded up to 1 KB, and
    the rest as a 16-bit cache's kernel has it."""
    variant = parse_variant(name)
    problem = Problem(heads=64, kv_format=fmt, mask="tree", lse=True)
    built = build(problem, variant)
    resources = built.module.resources[built.plan.main_kernel]
    assert not resources.spills, resources
    assert "constexpr bool FP8 = true;" in built.source and "dequantize_tile(stage_rows(kb), sKV);" in built.source
    row = 576 if fmt == "e4m3" else 656
    staged = -(-variant.stages * variant.block_n * row // 1024) * 1024
    assert built.plan.fp8_staging_bytes == staged and built.plan.kv_row_bytes == row
    bf16 = validate(Problem(heads=64, mask="tree", lse=True), variant)
    tiles = variant.stages * variant.block_n * 576 * 2
    assert built.plan.smem_bytes == bf16.smem_bytes - tiles + variant.block_n * 576 * 2 + staged
    # e4m3's stored values enter the tile unscaled; kv_scale scales the scores and the output.
    assert f"constexpr bool E4M3 = {'true' if fmt == 'e4m3' else 'false'};" in built.source
    assert "const float kv_scale = E4M3 ? kv_scale_of(p) : 1.f;" in built.source
    assert "p.scale_log2 * kv_scale" in built.source and "o[mt][nt][e] *= kv_scale" in built.source


def test_fp8_tiles_need_the_shared_memory_of_their_rows():
    """ds_mla's 656-byte rows in two stages do not fit the 64-row wgmma tile's shared memory; one
    stage does, and e4m3's two stages take what a 16-bit cache's two 16-bit tiles take."""
    two = parse_variant("mma_ht8_qt8_bn64_w8_st2_sp2_sm90a")
    with pytest.raises(SpecError, match="shared memory per block on sm_90a"):
        validate(Problem(kv_format="ds_mla"), two)
    assert validate(Problem(kv_format="ds_mla"), two.with_(stages=1))
    assert validate(Problem(kv_format="e4m3"), two).smem_bytes == validate(Problem(), two).smem_bytes


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_tiles_e4m3_bit_moves_give_every_value_exactly(dtype):
    """The tiles' dequantize moves an e4m3 byte's bits into a 16-bit value (E4M3_SHIFT) and
    multiplies by E4M3_UNIT, both as rendered: for each of the 254 finite e4m3 codes, denormals
    and both zeros included, that is the e4m3 value, exactly, in q's dtype."""
    source = build(Problem(kv_format="e4m3", dtype=dtype), parse_variant(FP8_TILES[0][1])).source
    shift = int(re.search(r"constexpr int E4M3_SHIFT = (\d+);", source).group(1))
    unit = float.fromhex(re.search(r"constexpr float E4M3_UNIT = (0x1p\d+)f;", source).group(1))
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.int32)   # 0x7f, 0xff: NaN
    top = codes << 8                                                 # the byte at the top of a 16-bit half
    bits = (top & 0x8000) | ((top & 0x7F00) >> shift)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    moved = bits.to(torch.int16).view(torch_dtype).double() * unit
    expected = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    assert torch.equal(moved, expected)
    assert torch.equal(moved.to(torch_dtype).double(), expected)     # and the product is exact in q's dtype
    assert torch.equal(torch.signbit(moved), torch.signbit(expected))


@pytest.mark.parametrize("fmt", FP8)
def test_the_dispatcher_runs_fp8_caches_on_the_heuristic_tile(fmt):
    """Without a table an FP8 cache runs on the heuristic's mma tile (lockstep, cp.async loads;
    the balanced split for a batch), on every arch where one fits (H=16 S=9 and 64: all), else on
    the naive variant; batch-invariant mode runs on the naive variant, and e4m3 queries on the
    tile's fp8_mma schedule over an e4m3 cache on sm_90a (where it fits), else on the naive
    variant. Every pick validates."""
    for arch in ARCHS:
        for seqlen_q, batch in ((1, 1), (9, 32), (64, 4)):
            problem = Problem(heads=16, kv_format=fmt, mask="tree")
            tile = fp8_tile(problem, seqlen_q, arch, H200)
            picked = choose_variant(problem, seqlen_q, batch, 4096, arch, policy=H200)
            if tile is None:
                assert seqlen_q == 1 and picked == naive(arch), (arch, seqlen_q)
            else:
                assert (tile.family, tile.schedule, tile.loads) == ("mma", "lockstep", "cp_async")
                assert picked == (tile if batch == 1 else tile.with_(kv_split="balanced"))
            assert validate(problem, picked)
            assert batch_invariant_variant(problem, seqlen_q, arch, H200) == naive(arch)
            q8 = problem.with_(q_format="e4m3")
            q8_pick = choose_variant(q8, seqlen_q, batch, 4096, arch, policy=H200)
            f8 = fmt == "e4m3" and tile is not None and FP8_MMA.takes(tile)
            assert q8_pick.schedule == "fp8_mma" if f8 else q8_pick == naive(arch), (arch, q8_pick.name)
            assert validate(q8, q8_pick) and validate(problem, naive(arch))


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_naive_kernels_compile_without_spills(fmt, arch):
    """The naive kernel reads each format on every arch (sm_80 through cuda_fp8.h's conversion,
    the newer ones with cvt): no spills, q in either 16-bit dtype."""
    for dtype in ("bf16", "fp16"):
        built = build(Problem(heads=16, kv_format=fmt, dtype=dtype, mask="tree", lse=True), naive(arch))
        resources = built.module.resources[built.plan.main_kernel]
        assert not resources.spills, resources
        assert "kv_chunk" in built.source and ("cuda_fp8.h" in built.source)


@pytest.mark.parametrize("arch", ARCHS)
def test_e4m3_query_kernels_compile_without_spills(arch):
    """e4m3 queries over each cache format on the naive kernel; the tiled families refuse them."""
    for kv_format in ("dtype", *FP8):
        problem = Problem(heads=8, kv_format=kv_format, q_format="e4m3", mask="causal", lse=True)
        built = build(problem, naive(arch))
        assert not built.module.resources[built.plan.main_kernel].spills
        assert "typedef unsigned char q_t;" in built.source and "q_scale_of(p)" in built.source
    assert Problem(q_format="e4m3").name == "h64_dl512_dr64_bf16_qe4m3_p64_causal"
    with pytest.raises(SpecError, match="'naive' for problem.q_format='e4m3'"):
        validate(Problem(q_format="e4m3"), parse_variant("mma_ht64_qt1_bn64_w8_st2_spa_sm90"))


def test_16bit_caches_render_no_fp8_code():
    source = build(Problem(), naive()).source
    assert "cuda_fp8.h" not in source and "typedef elem_t kv_t;" in source


def _fp8_case(fmt: str, mask: str, page_size: int, scale_as_tensor: bool, seed: int):
    """A case whose cache is quantized to `fmt` (NaN pages stay NaN), with its kv_scale."""
    case = make_case(batch=3, seqlen_q=4, heads=16, prefixes=[300, 0, 1000], page_size=page_size, mask=mask,
                     seed=seed, empty=[False, True, False])
    cache, scale = mlagen.quantize_kv(case.kv_cache, fmt)
    if scale is not None and not scale_as_tensor:
        scale = float(scale)
    return case, cache, scale


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_fp8_caches_match_the_reference_of_their_dequantized_rows(fmt, mask, page_size):
    """out and lse of every row against the fp64 reference over the same FP8 cache (dequantized
    as kv_formats specifies), with bf16's per-row tolerance: an empty request, NaN in unused pages
    and past each length, the e4m3 scale as a float and as a device tensor."""
    for seed, as_tensor in ((1, False), (2, True)):
        case, cache, scale = _fp8_case(fmt, mask, page_size, as_tensor, seed)
        out, lse = mlagen.verify_attention(case.q, cache, case.block_table, case.cache_seqlens, kv_scale=scale,
                                           return_lse=True, **case.kwargs())
        ref_out, ref_lse = mlagen.reference(case.q, cache, case.block_table, case.cache_seqlens, kv_scale=scale,
                                            dtype=torch.float64, **case.kwargs())
        problem = compare_rows(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2))
        assert problem is None, (fmt, mask, page_size, seed, problem)


@pytest.mark.gpu
def test_an_e4m3_scale_tensor_is_read_at_each_launch():
    """A graph captured with a scale tensor follows the tensor's value on replay."""
    case, cache, scale = _fp8_case("e4m3", "causal", 16, True, 3)
    run = lambda: mlagen.verify_attention(case.q, cache, case.block_table, case.cache_seqlens,  # noqa: E731
                                          kv_scale=scale, **case.kwargs())
    before = run().clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    scale.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, before)
    expected = mlagen.verify_attention(case.q, cache, case.block_table, case.cache_seqlens, kv_scale=float(scale),
                                       **case.kwargs())
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_flashmla_fp8_rows_through_the_compat_api():
    """flash_mla_with_kvcache(is_fp8_kvcache=True) on ds_mla rows gives the op's bits (FlashMLA's
    +inf lse for the empty request)."""
    from mlagen.compat import flash_mla

    case, cache, _ = _fp8_case("ds_mla", "causal", 64, False, 4)
    out, lse = flash_mla.flash_mla_with_kvcache(case.q, cache[:, :, None], case.block_table, case.cache_seqlens,
                                                512, None, softmax_scale=case.scale, causal=True, is_fp8_kvcache=True)
    ref_out, ref_lse = mlagen.verify_attention(case.q, cache, case.block_table, case.cache_seqlens, return_lse=True,
                                               **case.kwargs())
    assert torch.equal(out, ref_out)
    assert torch.equal(lse, ref_lse.masked_fill(ref_lse == -float("inf"), float("inf")))


def test_fp8_presets_emit_their_kernels_with_a_scale_taking_launcher(tmp_path):
    """`mlagen emit --preset kimi-k2-fp8 --launcher` writes the naive kernels and the mma tiles
    that stage FP8 rows, with C++ launchers whose launch takes kv_scale (or a device pointer) for
    the e4m3 cache, and checks its row strides in 16-byte multiples; the ds_mla preset's rows are
    656 bytes and take no scale."""
    from mlagen.dispatch.presets import PRESETS
    from mlagen.tools.launcher import render_launcher

    e4m3 = render_launcher(validate(PRESETS["kimi-k2-fp8"].problem, naive("sm_90")))
    assert "constexpr bool kE4m3Cache = true;" in e4m3 and "constexpr int kKvRowElems = 576;" in e4m3
    assert "p.kv_scale_ptr = kE4m3Cache ? kv_scale_ptr : nullptr;" in e4m3
    assert "p.kv_scale = kE4m3Cache ? kv_scale : 1.0f;" in e4m3 and "constexpr int kKvAlignElems = 16;" in e4m3
    ds = render_launcher(validate(PRESETS["deepseek-v3-fp8"].problem, naive("sm_90")))
    assert "constexpr bool kE4m3Cache = false;" in ds and "constexpr int kKvRowElems = 656;" in ds
    from typer.testing import CliRunner

    from cli import app

    result = CliRunner().invoke(app, ["emit", "--preset", "kimi-k2-fp8", "--launcher", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "kimi-k2-fp8").rglob("*.cu"))
    assert names and all("_kve4m3_" in n for n in names), names
    assert {n.split("_")[1] for n in names} == {"naive", "mma"}, names


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["dtype", *FP8])
def test_e4m3_queries_match_the_reference_of_their_dequantized_values(kv_format):
    """float8_e4m3fn queries with q_scale (a float and a tensor) over each cache, from bf16 and fp16
    values: every row against the fp64 reference of the same FP8 inputs, with bf16's per-row
    tolerance; out in the 16-bit cache's dtype, bf16 over an FP8 cache."""
    for seed, as_tensor, dtype in ((5, False, torch.bfloat16), (6, True, torch.float16)):
        case = make_case(batch=3, seqlen_q=4, heads=16, prefixes=[300, 0, 1000], page_size=16, mask="tree",
                         seed=seed, empty=[False, True, False], dtype=dtype, kv_format=kv_format, q_format="e4m3")
        if not as_tensor:
            case.q_scale = float(case.q_scale)
            case.kv_scale = None if case.kv_scale is None else float(case.kv_scale)
        out, lse = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                           return_lse=True, **case.kwargs())
        ref_out, ref_lse = case.reference(torch.float64)
        assert out.dtype == (dtype if kv_format == "dtype" else torch.bfloat16)
        problem = compare_rows(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2))
        assert problem is None, (kv_format, seed, problem)


# ---- FP8 through varlen and context-parallel shards

def _fp8_inputs(fmt: str, device: str, seed: int, page_size: int = 16):
    """(case, e4m3 queries, their q_scale tensor, FP8 cache, kv_scale): a tree-masked ragged case."""
    case = make_case(batch=3, seqlen_q=4, heads=16, prefixes=[300, 0, 70], page_size=page_size, mask="tree",
                     seed=seed, empty=[False, True, False], device=device, per_request_tree=True)
    cache, kv_scale = mlagen.quantize_kv(case.kv_cache, fmt)
    q8, q_scale = mlagen.quantize_q(case.q)
    return case, q8, q_scale, cache, kv_scale


def _packed(case, q8):
    """The case's queries packed for varlen: request b keeps its last s_b = (2, 4, 3)[b] queries
    (cu_seqlens_q), and the packed tree mask takes the case's corner over its last s_b tokens.
    Returns (packed q, cu_seqlens_q, packed mask, the dense mask that gives those rows the same
    visibility: every earlier token seen), counts."""
    counts = [2, 4, 3]
    S = case.q.shape[1]
    q = torch.cat([q8[b, S - s:] for b, s in enumerate(counts)])
    cu = torch.tensor([0, 2, 6, 9], dtype=torch.int32, device=q8.device)
    mask = torch.zeros(3, S, S, dtype=torch.bool, device=q8.device)
    dense = torch.ones(3, S, S, dtype=torch.bool, device=q8.device)
    for b, s in enumerate(counts):
        mask[b, :s, :s] = dense[b, S - s:, S - s:] = case.tree_mask[b, S - s:, S - s:]
    return q, cu, mask, dense, counts


def _check_varlen_fp8(case, q8, q_scale, cache, kv_scale, tol=None):
    """verify_attention_varlen on e4m3 queries over an FP8 cache: every packed row against the
    dense reference's row at its position (request b's last s_b queries see its last s_b draft
    tokens through the same tree), within `tol` (None: bf16's)."""
    q, cu, mask, dense, counts = _packed(case, q8)
    kw = dict(softmax_scale=case.scale, head_dim_v=512, kv_scale=kv_scale, q_scale=q_scale)
    out, lse = mlagen.verify_attention_varlen(q, cache, case.block_table, case.cache_seqlens, cu, 4, tree_mask=mask,
                                              return_lse=True, **kw)
    assert out.dtype == torch.bfloat16 and out.shape == (9, 16, 512) and lse.shape == (16, 9)
    ref_out, ref_lse = mlagen.reference(q8, cache, case.block_table, case.cache_seqlens, tree_mask=dense,
                                        dtype=torch.float64, **kw)
    S = case.q.shape[1]
    rows = [(b, i) for b, s in enumerate(counts) for i in range(S - s, S)]
    ref_rows = torch.stack([ref_out[b, i] for b, i in rows])
    ref_lse_rows = torch.stack([ref_lse[b, :, i] for b, i in rows])
    problem = compare_rows(out, lse.T, ref_rows, ref_lse_rows, tol, dims=("row", "h"))
    assert problem is None, problem


def _check_cp_fp8(case, q8, q_scale, cache, kv_scale, tol=None):
    """Two context-parallel ranks over their shards of the FP8 cache, merged: the unsharded
    reference of the same e4m3 queries and cache, within `tol` (None: bf16's)."""
    kw = dict(softmax_scale=case.scale, tree_mask=case.tree_mask, kv_scale=kv_scale, q_scale=q_scale)
    parts = []
    for rank in range(2):
        kv, table, _ = mlagen.cp_shard_cache(cache, case.block_table, case.cache_seqlens, rank=rank, world=2)
        assert kv.dtype == cache.dtype
        parts.append(mlagen.verify_attention_cp_shard(q8, kv, table, case.cache_seqlens, rank=rank, world=2, **kw))
    out, lse = mlagen.merge_states(*parts[0], *parts[1])
    ref_out, ref_lse = mlagen.reference(q8, cache, case.block_table, case.cache_seqlens, dtype=torch.float64, **kw)
    problem = compare_rows(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2), tol)
    assert problem is None, problem


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("check", [_check_varlen_fp8, _check_cp_fp8])
def test_varlen_and_shards_carry_both_scales(fmt, check, monkeypatch):
    """On the CPU, the fp64 reference standing in for the kernels: varlen (e4m3 rows padded as
    bytes) and the shard functions pass kv_scale and q_scale through, and cp_shard_cache moves
    FP8 rows as they are."""
    monkeypatch.setattr(context_parallel, "verify_attention", reference_op)
    monkeypatch.setattr(varlen, "verify_attention", reference_op)
    check(*_fp8_inputs(fmt, "cpu", seed=11))


def test_empty_varlen_batches_of_e4m3_queries_return_bf16():
    q = torch.zeros(0, 16, 576, dtype=torch.float8_e4m3fn)
    cache = torch.zeros(4, 16, 576, dtype=torch.float8_e4m3fn)
    out, lse = mlagen.verify_attention_varlen(q, cache, torch.zeros(1, 2, dtype=torch.int32),
                                              torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                                              1, return_lse=True, kv_scale=1.0, q_scale=1.0)
    assert out.shape == (0, 16, 512) and out.dtype == torch.bfloat16 and lse.shape == (16, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("check", [_check_varlen_fp8, _check_cp_fp8])
def test_varlen_and_shards_of_fp8_inputs_match_the_reference(fmt, check):
    """The same checks through the kernels."""
    check(*_fp8_inputs(fmt, "cuda", seed=12))


@pytest.mark.gpu
@pytest.mark.parametrize("check", [_check_varlen_fp8, _check_cp_fp8])
def test_varlen_and_shards_of_e4m3_queries_on_e4m3_products(check):
    """With pages of 64 keys the dispatcher runs e4m3 queries over an e4m3 cache on the fp8_mma
    schedule on sm_90a: varlen's padded rows and two context-parallel shards merged, within the
    e4m3 products' tolerance."""
    require_target("sm_90a")
    check(*_fp8_inputs("e4m3", "cuda", seed=13, page_size=64), tol=FP8_PRODUCTS_TOLERANCE)


# ---- e4m3 queries against the 16-bit queries they come from

def _query_pairs(seeds: range, device: str):
    """(fuzz shape, its case with 16-bit queries, the same case with e4m3 queries) per seed, over
    every cache format."""
    space = FuzzSpace(max_prefix=3000, max_work=2e8, kv_formats=("dtype", *FP8))
    for seed in seeds:
        shape = draw(seed, space)
        yield (shape, dataclasses.replace(shape, q_format="dtype").case(device),
               dataclasses.replace(shape, q_format="e4m3").case(device))


def test_e4m3_queries_stay_within_their_stated_bound():
    """The reference over e4m3 queries against the reference over the 16-bit queries they were
    quantized from: every row within E4M3_QUERY_TOLERANCE, and some row beyond bf16's own
    tolerance (the bound is the queries' rounding, not a kernel's)."""
    coarser = 0
    for shape, c16, c8 in _query_pairs(range(40), "cpu"):
        out, lse = c8.reference(torch.float64)
        lse = lse.float()
        ref_out, ref_lse = c16.reference(torch.float64)
        problem = compare_rows(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2), E4M3_QUERY_TOLERANCE)
        assert problem is None, (str(shape), problem)
        coarser += compare_rows(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2),
                                tolerance(torch.bfloat16)) is not None
    assert coarser > 20


@pytest.mark.gpu
def test_the_op_on_e4m3_queries_stays_within_the_bound():
    """The op on e4m3 queries (the dispatcher's pick) against the fp64 reference of the 16-bit
    queries, every row within E4M3_QUERY_TOLERANCE."""
    for shape, c16, c8 in _query_pairs(range(40, 64), "cuda"):
        out, lse = mlagen.verify_attention(c8.q, c8.kv_cache, c8.block_table, c8.cache_seqlens, return_lse=True,
                                           **c8.kwargs())
        ref_out, ref_lse = c16.reference(torch.float64)
        problem = compare_rows(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2), E4M3_QUERY_TOLERANCE)
        assert problem is None, (str(shape), problem)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,name", FP8_TILES)
@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_fp8_tiles_match_the_reference_of_their_dequantized_rows(fmt, name, mask):
    """Each FP8 tile this GPU runs, on shuffled pages among NaN ones (one page size a 64-key tile
    spans, one it does not), an empty request, the e4m3 scale as a float and as a device tensor,
    ds_mla's group scales as powers of two and (the second case) half of them not (vLLM's
    unrounded scales): every row against the fp64 reference over the same FP8 cache, with
    bf16's tolerance; with unrounded scales, over the cache dequantized and rounded to q's dtype,
    as the tiles use it (the rounding errs alike for equal stored values of a group, a bias that
    moves the lse past bf16's tolerance on long requests; docs/design.md)."""
    variant = parse_variant(name)
    require_target(variant.arch)
    for seed, (page_size, as_tensor) in enumerate(((16, False), (64, True))):
        case = make_case(batch=3, seqlen_q=5, heads=64, prefixes=[700, 0, 3500], page_size=page_size, mask=mask,
                         seed=30 + seed, empty=[False, True, False])
        cache, scale = mlagen.quantize_kv(case.kv_cache, fmt)
        scale = scale if as_tensor or scale is None else float(scale)
        ref_cache = cache
        if fmt == "ds_mla" and seed == 1:
            cache[..., kv_layout.SCALES_AT:kv_layout.ROPE_AT].view(torch.float32)[..., 1::2] *= 1.37
            ref_cache = mlagen.dequantize_kv(cache, fmt, dtype=case.q.dtype).reshape(case.kv_cache.shape)
        out, lse = mlagen.verify_attention(case.q, cache, case.block_table, case.cache_seqlens, kv_scale=scale,
                                           variant=variant, return_lse=True, **case.kwargs())
        ref_out, ref_lse = mlagen.reference(case.q, ref_cache, case.block_table, case.cache_seqlens,
                                            kv_scale=scale if ref_cache is cache else None,
                                            dtype=torch.float64, **case.kwargs())
        problem = compare_rows(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2))
        assert problem is None, (name, mask, page_size, problem)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "ds_mla"])
def test_fp8_tiles_run_ragged_rows(fmt):
    """The sm_90a FP8 tile as a balanced split with ragged rows, as the dispatcher runs a balanced
    FP8 table pick for a call with q_counts: 12 requests of 0..9 real rows, each real row against
    the fp64 reference over the same FP8 cache."""
    require_target("sm_90a")
    case = make_case(batch=12, seqlen_q=9, heads=16, page_size=64, mask="tree", per_request_tree=True, seed=71,
                     prefixes=[900, 0, 2000, 70, 1500, 300, 2600, 5, 1200, 800, 0, 1700])
    counts = [9, 0, 4, 1, 9, 6, 2, 9, 5, 3, 7, 8]
    cache, scale = mlagen.quantize_kv(case.kv_cache, fmt)
    problem = Problem(heads=16, mask="tree", lse=True, kv_format=fmt)
    variant = fp8_tile(problem, 9, "sm_90a", H200).with_(kv_split="balanced", rows="ragged")
    assert validate(problem, variant).split.ragged_rows
    q_counts = torch.tensor(counts, dtype=torch.int32, device="cuda")
    out, lse = mlagen.verify_attention(case.q, cache, case.block_table, case.cache_seqlens, kv_scale=scale,
                                       variant=variant, return_lse=True, q_counts=q_counts, **case.kwargs())
    ref_out, ref_lse = mlagen.reference(case.q, cache, case.block_table, case.cache_seqlens, kv_scale=scale,
                                        dtype=torch.float64, **case.kwargs())
    rows = [(b, i) for b, c in enumerate(counts) for i in range(9 - c, 9)]
    problem_rows = compare_rows(torch.stack([out[b, i] for b, i in rows]),
                                torch.stack([lse[b, :, i] for b, i in rows]),
                                torch.stack([ref_out[b, i] for b, i in rows]),
                                torch.stack([ref_lse[b, :, i] for b, i in rows]), dims=("row", "h"))
    assert problem_rows is None, problem_rows


def test_fp8_caches_name_the_schedules_and_loads_that_stage_them():
    """An FP8 cache on a schedule that stages no FP8 rows names the ones that do; on loads that
    do not stage them, the loads that do."""
    with pytest.raises(SpecError, match=r"^variant.schedule: got 'seesaw', expected 'lockstep' or 'fp8_ws' or "
                                        r"'fp8_mma' or 'fp8_ldg' for problem.kv_format='ds_mla' \(the mma family's "
                                        r"loops that stage FP8 rows\)"):
        validate(Problem(kv_format="ds_mla"), parse_variant("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a"))
    with pytest.raises(SpecError, match=r"^variant.loads: got 'tma', expected 'cp_async' for "
                                        r"problem.kv_format='ds_mla' \(the loads that stage FP8 rows\)"):
        validate(Problem(kv_format="ds_mla"), parse_variant("mma_ht64_qt1_bn64_w8_st2_spa_tma_sm90a"))
