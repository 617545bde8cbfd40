"""Sparse verify (DeepSeek Sparse Attention): `verify_attention(..., indices=, topk_length=)`, each
query token over the cache rows it lists. On the CPU: the DSL's rules for gathered keys, the
dispatcher's pick and the kernels compiled for every arch and cache format. On a GPU: every row
against the fp64 reference (`mlagen.sparse_reference`) of the same inputs, over the cache formats,
page sizes 1 to 128, head counts and S up to DeepSeek-V3.2's, with unused slots, duplicate rows,
empty rows, NaN wherever no slot may read, row ids outside the cache, attention sinks, the
custom op and CUDA graph replay with indices changed in place."""

from __future__ import annotations

import math

import pytest
import torch

import mlagen
from mlagen.codegen.build import build
from mlagen.dispatch.policy import H200, batch_invariant_variant, choose_variant
from mlagen.dsl.errors import SpecError
from mlagen.dsl.spec import Problem, naive, parse_variant
from mlagen.plan.validate import validate
from mlagen.runtime.inputs import InputError
from mlagen.runtime.op import device_info
from mlagen.tools.testing import SparseCase, assert_rows_match, make_sparse_case, tolerance

GATHERED = Problem(mask="none", keys="gathered")
TILE = "mma_ht64_qt1_bn64_w8_st2_spa_p16_sm90a"     # the dispatcher's pick for 64 and 128 heads on an H100


def test_gathered_keys_take_no_mask_and_their_own_tiles():
    """A gathered problem is named `_gather` and takes mask "none" only; it runs on the naive
    family and on the mma family's lockstep loop with cp.async loads, a row group of one query
    token and a fixed or adaptive split. Each refusal names the field and what it needs."""
    assert GATHERED.gathered and GATHERED.name.endswith("_none_gather")
    assert validate(GATHERED, naive("sm_90a")).problem == GATHERED
    assert validate(GATHERED, parse_variant(TILE))
    with pytest.raises(SpecError, match=r"problem.mask: got 'causal', expected 'none' with problem.keys='gathered'"):
        validate(GATHERED.with_(mask="causal"), naive())
    with pytest.raises(SpecError, match=r"variant.family: got 'flash', expected 'naive' or 'mma' for "
                                        r"problem.keys='gathered'"):
        validate(GATHERED, parse_variant("flash_ht8_qt1_bn32_w8_st2_spa_sm90"))
    for change, match in (
            (dict(schedule="seesaw", loads="tma"), r"variant.schedule: got 'seesaw', expected 'lockstep'"),
            (dict(loads="tma"), r"variant.loads: got 'tma', expected 'cp_async'"),
            (dict(q_tile=2, head_tile=32), r"variant.q_tile: got 2, expected 1 for problem.keys='gathered'"),
            (dict(kv_split="balanced"), r"variant.kv_split: got 'balanced', expected an int or 'adaptive'")):
        with pytest.raises(SpecError, match=match):
            validate(GATHERED, parse_variant(TILE).with_(**change))
    with pytest.raises(SpecError, match="problem.keys: got 'dense'"):
        validate(GATHERED.with_(keys="dense"), naive())
    with pytest.raises(SpecError, match="problem.page_size: got 61, expected a power of two"):
        validate(Problem(page_size=61), naive())


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_120"])
def test_the_dispatcher_runs_gathered_keys_on_a_one_token_tile(arch):
    """The pick is the heuristic's mma tile for one query token (q_tile 1, adaptive split), in
    every cache format."""
    for problem in (GATHERED, GATHERED.with_(heads=128, kv_format="ds_mla", lse=True, page_size=61)):
        v = choose_variant(problem, 2, 8, 2048, arch, "")
        assert v.family == "mma" and v.q_tile == 1 and v.kv_split == "adaptive" and v.schedule == "lockstep"
        assert validate(problem, v)


@pytest.mark.parametrize("heads,seqlen_q", [(128, 2), (16, 4), (64, 9)])
def test_batch_invariant_mode_runs_gathered_keys_on_the_naive_kernel(heads, seqlen_q):
    """Batch-invariant mode takes the kernel without a split for gathered keys, in every format."""
    for problem in (GATHERED.with_(heads=heads), GATHERED.with_(heads=heads, kv_format="ds_mla")):
        assert batch_invariant_variant(problem, seqlen_q, "sm_90", H200) == naive("sm_90")


@pytest.mark.parametrize("kv_format", ["dtype", "e4m3", "ds_mla"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_120"])
def test_gathered_kernels_compile_reading_listed_rows(arch, kv_format):
    """Each cache format's gathered kernels, naive and the dispatched tile, compile on every
    arch with a page size that is no power of two, and read their keys through the rows each
    token lists, never through a block table."""
    problem = GATHERED.with_(kv_format=kv_format, lse=True, page_size=61, heads=128)
    for variant in (naive(arch), choose_variant(problem, 2, 8, 2048, arch, "")):
        built = build(problem, variant, use_cache=False)
        assert built.module.cubin
        assert "listed_row_at(p, " in built.source and "kv_page(p, b, j)" not in built.source


# ---- on a GPU

def device_arch() -> str:
    return device_info(torch.cuda.current_device())[0]


def _run(case: SparseCase, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    return mlagen.verify_attention(case.q, case.kv_cache, return_lse=True, **(case.kwargs() | kw))


def _check(case: SparseCase, out: torch.Tensor, lse: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> None:
    """Every row (b, i, h) of out and lse against the fp64 reference, with the tolerance of the
    16-bit output (the naive kernel dequantizes FP8 inputs exactly)."""
    ref_out, ref_lse = ref if ref is not None else case.reference(torch.float64)
    assert_rows_match(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2), tolerance(out.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format,q_format,dtype", [
    ("dtype", "dtype", torch.bfloat16), ("dtype", "dtype", torch.float16), ("e4m3", "dtype", torch.bfloat16),
    ("ds_mla", "dtype", torch.bfloat16), ("e4m3", "e4m3", torch.bfloat16), ("ds_mla", "e4m3", torch.bfloat16),
])
@pytest.mark.parametrize("page_size,heads,seqlen_q", [(1, 16, 1), (16, 64, 4), (61, 64, 3), (64, 128, 2), (128, 8, 3)])
@pytest.mark.parametrize("kernel", ["dispatched", "naive"])
def test_every_row_matches_the_reference(kv_format, q_format, dtype, page_size, heads, seqlen_q, kernel):
    """Ragged topk_length (one request with none), a quarter of the slots unused, duplicate rows,
    NaN pages listed past each length and in no used slot; out poisoned with NaN beforehand. The
    dispatcher's pick (the one-token mma tile; e4m3 queries: the naive kernel) and the naive
    kernel."""
    case = make_sparse_case(batch=3, seqlen_q=seqlen_q, heads=heads, topk=192, pages=max(2, 640 // page_size),
                            page_size=page_size, seed=page_size + heads, lengths=[192, 0, 77], dtype=dtype,
                            kv_format=kv_format, q_format=q_format)
    out = torch.full((3, seqlen_q, heads, 512), math.nan, dtype=dtype, device="cuda")
    variant = naive(device_arch()) if kernel == "naive" else None
    result, lse = _run(case, out=out, variant=variant)
    assert result is out
    _check(case, out, lse)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 3, 16])
def test_deepseek_v32_shape_over_the_ds_mla_cache(splits):
    """H=128, S=2 (an MTP draft), topk 2048 over 64-key pages of DeepSeek's FP8 rows, every slot
    used (topk_length None), on the dispatched tile with its own split and with fixed ones."""
    case = make_sparse_case(batch=2, seqlen_q=2, heads=128, topk=2048, pages=96, page_size=64, seed=32,
                            unused=0.0, kv_format="ds_mla")
    picked = choose_variant(GATHERED.with_(heads=128, kv_format="ds_mla", lse=True), 2, 2, 2048, device_arch(), "")
    _check(case, *_run(case, variant=picked if splits is None else picked.with_(kv_split=splits)))


@pytest.mark.gpu
def test_one_row_listed_in_every_slot_gives_that_row():
    """Every slot listing the same row: uniform weights over copies of one key, so each output
    row is that row's values and lse its score plus log(topk) (duplicates count as keys)."""
    case = make_sparse_case(batch=1, seqlen_q=2, heads=8, topk=100, pages=4, page_size=16, seed=5, unused=0.0)
    case.indices.fill_(37)
    out, lse = _run(case)
    row = case.kv_cache.reshape(-1, 576)[37].double()
    torch.testing.assert_close(out.double(), row[:512].expand_as(out), rtol=0, atol=1e-2)
    score = (case.q.double() @ row) * case.scale
    torch.testing.assert_close(lse.double(), (score + math.log(100)).transpose(1, 2), rtol=0, atol=1e-3)


@pytest.mark.gpu
def test_row_ids_outside_the_cache_are_dropped_unchecked_and_named_when_checked():
    """Without check_values, ids past the cache or below -1 read nothing (the result is the
    reference's with them unused); with it, InputError names the id before any launch."""
    case = make_sparse_case(batch=2, seqlen_q=3, heads=16, topk=64, pages=8, page_size=16, seed=9)
    rows = case.kv_cache.size(0) * case.kv_cache.size(1)
    bad = case.indices.clone()
    bad[:, :, ::3] = rows + 1000
    bad[:, :, 1::7] = -5
    expected = SparseCase(**{**case.__dict__, "indices": torch.where((bad < 0) | (bad >= rows), -1, bad)})
    broken = SparseCase(**{**case.__dict__, "indices": bad})
    _check(broken, *_run(broken, check_values=False), ref=expected.reference(torch.float64))
    with pytest.raises(InputError, match=rf"indices: got a row id (-5|{rows + 1000})"):
        _run(broken, check_values=True)


@pytest.mark.gpu
def test_attention_sinks_scale_each_row():
    case = make_sparse_case(batch=2, seqlen_q=2, heads=8, topk=128, pages=8, page_size=32, seed=13, lengths=[128, 0])
    sink = torch.tensor([math.inf, -math.inf, 0.0, 1.5, -2.0, 3.0, 0.5, -0.5], device="cuda")
    out, lse = _run(case, attn_sink=sink)
    ref_out, ref_lse = case.reference(torch.float64)
    keep = torch.exp(ref_lse) / (torch.exp(ref_lse) + torch.exp(sink.double())[None, :, None])   # [B, H, S]
    ref_out = ref_out * keep.nan_to_num(0.0).transpose(1, 2)[..., None]
    _check(case, out, lse, ref=(ref_out, ref_lse))
    assert (out[:, :, 0] == 0).all()


@pytest.mark.gpu
def test_custom_op_and_graph_replay_with_indices_changed_in_place():
    """The custom op gives verify_attention's bits; a captured graph, replayed after indices and
    topk_length change in place, gives the new inputs' result."""
    case = make_sparse_case(batch=2, seqlen_q=4, heads=32, topk=256, pages=16, page_size=64, seed=21,
                            lengths=[256, 100], kv_format="ds_mla")
    direct = _run(case)
    through_op = mlagen.verify_attention_op(case.q, case.kv_cache, return_lse=True, **case.kwargs())
    assert all(torch.equal(a, b) for a, b in zip(direct, through_op, strict=True))
    graph = torch.cuda.CUDAGraph()
    _run(case)   # loaded before the capture
    with torch.cuda.graph(graph):
        captured = _run(case)
    case.indices.copy_(case.indices.flip(1))      # other rows for each token, NaN rows still past each length
    case.topk_length.copy_(torch.tensor([30, 100], dtype=torch.int32))
    graph.replay()
    _check(case, *captured)


def test_varlen_gathered_keys_name_bad_shapes():
    q = torch.zeros(5, 8, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    with pytest.raises(InputError, match=r"indices.shape: got \(5, 1, 64\), expected \[total_q=5, topk\]"):
        mlagen.verify_attention_varlen(q, kv, None, None, cu, 3, indices=torch.zeros(5, 1, 64, dtype=torch.int32),
                                       causal=False)
    with pytest.raises(InputError, match=r"topk_length.shape: got \(5,\), expected \[B=3\]"):
        mlagen.verify_attention_varlen(q, kv, None, None, cu, 3, indices=torch.zeros(5, 64, dtype=torch.int32),
                                       topk_length=torch.zeros(5, dtype=torch.int32), causal=False)


@pytest.mark.gpu
def test_varlen_gathered_keys_run_each_token_over_its_request_length():
    """Packed tokens (draft counts 2, 0, 3) with indices [total_q, topk] and topk_length per
    request: every token's row against the reference of the same token with its request's
    length; lse comes back [H, total_q]."""
    per_token = [150, 150, 40, 40, 40]
    case = make_sparse_case(batch=5, seqlen_q=1, heads=16, topk=150, pages=12, page_size=16, seed=41,
                            lengths=per_token, kv_format="ds_mla")
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device="cuda")
    out, lse = mlagen.verify_attention_varlen(
        case.q[:, 0], case.kv_cache, None, None, cu, 3, indices=case.indices[:, 0],
        topk_length=torch.tensor([150, 7, 40], dtype=torch.int32, device="cuda"), softmax_scale=case.scale,
        causal=False, return_lse=True)
    assert out.shape == (5, 16, 512) and lse.shape == (16, 5)
    _check(case, out[:, None], lse.T[:, :, None])


@pytest.mark.gpu
def test_batch_invariant_gathered_keys_give_a_requests_bits_alone_or_in_a_batch():
    """In batch-invariant mode a request's out and lse bits are the same run alone and inside a
    batch of others."""
    case = make_sparse_case(batch=4, seqlen_q=2, heads=128, topk=1024, pages=40, page_size=64, seed=51,
                            lengths=[1024, 300, 0, 700], kv_format="ds_mla")
    batch = _run(case, batch_invariant=True)
    for b in range(4):
        alone = SparseCase(**{**case.__dict__, "q": case.q[b:b + 1], "indices": case.indices[b:b + 1],
                              "topk_length": case.topk_length[b:b + 1]})
        out, lse = _run(alone, batch_invariant=True)
        assert torch.equal(out, batch[0][b:b + 1]) and torch.equal(lse, batch[1][b:b + 1]), b
    _check(case, *batch)


# ---- an extra cache (FlashMLA's), attended in the same softmax

def _extra_cases(device: str) -> tuple[SparseCase, SparseCase]:
    main = make_sparse_case(batch=3, seqlen_q=2, heads=8, topk=50, pages=6, page_size=16, seed=61,
                            lengths=[50, 0, 20], device=device)
    extra = make_sparse_case(batch=3, seqlen_q=2, heads=8, topk=30, pages=5, page_size=32, seed=62,
                             lengths=[0, 0, 30], device=device)
    return main, extra


def _with_extra(main: SparseCase, extra: SparseCase, **kw):
    return mlagen.verify_attention(main.q, main.kv_cache, return_lse=True, extra_kv_cache=extra.kv_cache,
                                   extra_indices=extra.indices, extra_topk_length=extra.topk_length,
                                   **(main.kwargs() | kw))


def _extra_reference(main: SparseCase, extra: SparseCase) -> tuple[torch.Tensor, torch.Tensor]:
    return mlagen.sparse_reference(main.q, main.kv_cache, main.indices, main.topk_length, softmax_scale=main.scale,
                                   dtype=torch.float64, extra_kv_cache=extra.kv_cache, extra_indices=extra.indices,
                                   extra_topk_length=extra.topk_length)


def test_an_extra_cache_merges_both_caches_keys(monkeypatch):
    """The two caches' results (the reference standing in for the kernels, on the CPU) merge
    into the result over both caches' keys, written into the given out: request 1 has none (out 0, lse -inf), request 0
    only the main cache's, request 2 both, the extra one on pages of another size."""
    from mlagen.runtime import op
    from mlagen.tools.testing import reference_op

    main, extra = _extra_cases("cpu")
    monkeypatch.setattr(op, "verify_attention", reference_op)
    given = torch.full((3, 2, 8, 512), math.nan, dtype=torch.bfloat16)
    out, lse = op._with_extra_keys(main.q, main.kv_cache, None, None, main.indices, main.topk_length, extra.kv_cache,
                                   extra.indices, extra.topk_length, return_lse=True, out=given,
                                   softmax_scale=main.scale, causal=False, head_dim_v=512)
    assert out is given
    _check(main, out, lse, ref=_extra_reference(main, extra))
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()


def test_sinks_over_an_extra_cache_apply_once_after_the_merge(monkeypatch):
    """verify_attention with attn_sink and an extra cache: the sink branch checks the sinks before
    any launch, runs both caches (the reference standing in for the kernels, on the CPU) into the
    given out, and scales the merged rows once by sigmoid(lse - sink)."""
    from mlagen.runtime import op
    from mlagen.tools.testing import reference_op

    main, extra = _extra_cases("cpu")
    entry = op.verify_attention
    monkeypatch.setattr(op, "verify_attention", reference_op)
    extra_args = dict(extra_kv_cache=extra.kv_cache, extra_indices=extra.indices, extra_topk_length=extra.topk_length)
    with pytest.raises(InputError, match=r"attn_sink.shape: got \(3,\), expected \(8,\)"):
        entry(main.q, main.kv_cache, attn_sink=torch.zeros(3), **main.kwargs(), **extra_args)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0, 0.5, 1.0, -3.0, 0.25])
    out = torch.full((3, 2, 8, 512), math.nan, dtype=torch.bfloat16)
    got, lse = entry(main.q, main.kv_cache, attn_sink=sink, out=out, return_lse=True, **main.kwargs(), **extra_args)
    ref_out, ref_lse = _extra_reference(main, extra)
    keep = torch.sigmoid(ref_lse.float() - sink[None, :, None]).nan_to_num(0.0).transpose(1, 2)[..., None]
    assert got is out
    torch.testing.assert_close(lse, ref_lse.float())
    torch.testing.assert_close(got.float(), (ref_out.float() * keep).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("change,match", [
    (dict(indices=None, causal=True), r"extra_kv_cache: got a Tensor, expected None without indices"),
    (dict(extra_indices=None), r"extra_kv_cache, extra_indices: got Tensor and NoneType, expected two tensors"),
    (dict(extra_kv_cache=torch.zeros(5, 32, 576, dtype=torch.float16)),
     r"extra_kv_cache.dtype: got torch.float16, expected kv_cache's torch.bfloat16"),
])
def test_bad_extra_caches_are_named(change, match):
    main, extra = _extra_cases("cpu")
    args = dict(main.kwargs(), extra_kv_cache=extra.kv_cache, extra_indices=extra.indices,
                extra_topk_length=extra.topk_length) | change
    with pytest.raises(InputError, match=match):
        mlagen.verify_attention(main.q, main.kv_cache, **args)


@pytest.mark.gpu
def test_an_extra_cache_on_the_gpu_with_sinks_and_out():
    main, extra = _extra_cases("cuda")
    out = torch.full((3, 2, 8, 512), math.nan, dtype=torch.bfloat16, device="cuda")
    got, lse = _with_extra(main, extra, out=out)
    assert got is out
    _check(main, out, lse, ref=_extra_reference(main, extra))
    sink = torch.full((8,), 0.5, device="cuda")
    sunk, _ = _with_extra(main, extra, attn_sink=sink)
    keep = torch.exp(lse) / (torch.exp(lse) + math.exp(0.5))
    torch.testing.assert_close(sunk.float(), (out.float() * keep.nan_to_num(0.0).transpose(1, 2)[..., None]),
                               rtol=1e-2, atol=1e-2)
