"""mlagen.compat.flash_mla on CPU: FlashMLA's signatures, defaults, metadata forms, argument
errors and conventions, several KV heads, attention sinks, FP8 rows and sparse attention's call
form through a stand-in op or on meta tensors (the op's fake implementation: shapes only), and
the sink's math against an fp64 formula. Numerics against the reference are GPU tests
(tests/test_gpu_dropin.py; FlashMLA's own sparse test file through benchmarks/flashmla_sparse_tests.py)."""

import inspect
import math

import pytest
import torch
from dropin_cases import FLASH_MLA_GRID, FLASH_MLA_ZERO_LENGTH, grid_axes

from mlagen.compat import flash_mla
from mlagen.runtime import inputs, op, sinks
from mlagen.runtime.inputs import InputError

# FlashMLA's flash_mla_with_kvcache, in order (deepseek-ai/FlashMLA, flash_mla/flash_mla_interface.py).
FLASH_MLA_PARAMETERS = ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                        "num_splits", "softmax_scale", "causal", "is_fp8_kvcache", "indices", "attn_sink",
                        "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length"]
EXTRA = ["extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length"]


def test_signatures_match_flash_mla():
    meta = inspect.signature(flash_mla.get_mla_metadata)
    assert [p.kind for p in meta.parameters.values()] == [inspect.Parameter.VAR_POSITIONAL,
                                                          inspect.Parameter.VAR_KEYWORD]
    run = inspect.signature(flash_mla.flash_mla_with_kvcache)
    positional = [n for n, p in run.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == FLASH_MLA_PARAMETERS
    defaults = {n: run.parameters[n].default for n in positional[6:]}
    assert defaults == {n: False if n in ("causal", "is_fp8_kvcache") else None for n in positional[6:]}
    for n in positional[:6]:
        assert run.parameters[n].default is inspect.Parameter.empty
    # mlagen's extensions are keyword-only, after FlashMLA's arguments.
    extensions = {n: p.default for n, p in run.parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert extensions == {"max_seqlen_k": None}
    assert list(run.parameters)[:len(positional)] == positional


def test_metadata_without_arguments():
    meta, none = flash_mla.get_mla_metadata()
    assert isinstance(meta, flash_mla.FlashMLASchedMeta) and none is None
    assert not meta.have_initialized and meta.config is None
    assert meta.tile_scheduler_metadata is None and meta.num_splits is None
    other, _ = flash_mla.get_mla_metadata()
    assert other is not meta                                  # a fresh object per call


@pytest.mark.parametrize("call", [
    lambda lens: flash_mla.get_mla_metadata(lens, 4 * 16, 1),
    lambda lens: flash_mla.get_mla_metadata(lens, 4 * 16, 1, 16),
    lambda lens: flash_mla.get_mla_metadata(lens, 4 * 16, 1, 16, False, None),
    lambda lens: flash_mla.get_mla_metadata(cache_seqlens=lens, num_q_tokens_per_head_k=64, num_heads_k=1),
    lambda lens: flash_mla.get_mla_metadata(lens, 64, num_heads_k=2, num_heads_q=32, is_fp8_kvcache=False, topk=None),
    lambda lens: flash_mla.get_mla_metadata(lens, 4 * 64 // 8, 8, 64),          # several KV heads
    lambda lens: flash_mla.get_mla_metadata(lens, 2 * 128, 1, 128, True, 2048),  # sparse attention's
])
def test_metadata_older_forms(call):
    lens = torch.tensor([5, 9, 0], dtype=torch.int32)
    metadata, splits = call(lens)
    assert metadata.dtype == splits.dtype == torch.int32
    assert metadata.shape == (1, 8) and splits.shape == (4,)
    assert metadata.device == splits.device == lens.device
    assert not metadata.any() and not splits.any()


def test_metadata_older_form_errors():
    lens = torch.tensor([5, 9, 0], dtype=torch.int32)
    assert flash_mla.get_mla_metadata(lens, 4, 1, is_fp8_kvcache=True)[0].shape == (1, 8)   # accepted
    assert flash_mla.get_mla_metadata(lens, 4, 1, num_heads_q=16, topk=2048)[1].shape == (4,)       # accepted
    for topk in (0, True, 64.0):
        with pytest.raises(InputError, match=rf"^topk: got {topk!r}, expected None or an int >= 1"):
            flash_mla.get_mla_metadata(lens, 4, 1, topk=topk)
    with pytest.raises(InputError, match=r"^num_heads_k: got 0, expected an int >= 1"):
        flash_mla.get_mla_metadata(lens, 4, 0)
    with pytest.raises(InputError, match=r"^num_heads_k: got True"):
        flash_mla.get_mla_metadata(lens, 4, True)
    with pytest.raises(InputError, match=r"^num_heads_q: got 9, expected None or a positive multiple of num_heads_k=2"):
        flash_mla.get_mla_metadata(lens, 4, 2, 9)
    with pytest.raises(InputError, match=r"^cache_seqlens: got list"):
        flash_mla.get_mla_metadata([5, 9], 4, 1)
    with pytest.raises(TypeError, match=r"^get_mla_metadata: .*num_heads_k.*expected no arguments, or"):
        flash_mla.get_mla_metadata(lens, 4)
    with pytest.raises(TypeError, match=r"^get_mla_metadata: .*'heads'"):
        flash_mla.get_mla_metadata(lens, 4, 1, heads=2)


def _inputs(B=2, S=2, H=16, H_kv=1, pages=4, page=64, device="cpu", dtype=torch.bfloat16):
    """q, k_cache, block_table and cache_seqlens of zeros (lengths 1) for FlashMLA's layouts."""
    q = torch.zeros(B, S, H, 576, dtype=dtype, device=device)
    k_cache = torch.zeros(pages, page, H_kv, 576, dtype=dtype, device=device)
    return (q, k_cache, torch.zeros(B, 2, dtype=torch.int32, device=device),
            torch.ones(B, dtype=torch.int32, device=device))


class _Calls(list):
    """The stand-in op's calls: (q, kv_cache, kwargs) each; `paged` holds each call's
    (block_table, cache_seqlens)."""

    def __init__(self):
        super().__init__()
        self.paged = []


@pytest.fixture
def fake_op(monkeypatch):
    """A stand-in for the op, recording its calls: out[b, i, h, :] = q[b, i, h, 0] + kv_cache's
    first element (so a test can tell which query head met which KV head), lse[b, h, i] the
    same, and -inf for request 0 (mlagen's mark for a row with no key)."""
    calls = _Calls()

    def op(q, kv_cache, block_table, cache_seqlens, **kwargs):
        calls.append((q, kv_cache, kwargs))
        calls.paged.append((block_table, cache_seqlens))
        B, S, H, _ = q.shape
        value = q[..., 0].float() + kv_cache.reshape(-1)[0].float()              # [B, S, H]
        out = value[..., None].expand(B, S, H, kwargs["head_dim_v"]).to(q.dtype).contiguous()
        lse = value.transpose(1, 2).clone()
        lse[0] = -math.inf
        if kwargs.get("attn_sink") is not None:                 # as the op applies its sinks
            sinks.apply_attn_sink_(out, lse.transpose(1, 2), kwargs["attn_sink"])
        return out, lse

    monkeypatch.setattr(flash_mla, "verify_attention_op", op)
    return calls


def test_defaults_and_empty_row_convention(fake_op):
    q, k_cache, block_table, lens = _inputs()
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, None)
    (seen_q, seen_kv, kwargs), = fake_op
    assert seen_q is q and seen_kv is k_cache              # one KV head: the arguments as given, one call
    assert kwargs == dict(softmax_scale=576 ** -0.5, causal=False, return_lse=True, head_dim_v=512, max_seqlen_k=None,
                          attn_sink=None)
    assert out.shape == (2, 2, 16, 512) and lse.shape == (2, 16, 2)
    assert (lse[0] == math.inf).all() and (lse[1] == 0).all()


def test_three_dim_cache_is_one_kv_head(fake_op):
    q, k_cache, block_table, lens = _inputs()
    cache3 = k_cache[:, :, 0]
    flash_mla.flash_mla_with_kvcache(q, cache3, block_table, lens, 512, *flash_mla.get_mla_metadata())
    (seen_q, seen_kv, _), = fake_op
    assert seen_q is q and seen_kv is cache3


@pytest.mark.parametrize("H, H_kv", [(2, 2), (9, 3), (16, 8), (128, 2)])
def test_several_kv_heads_run_one_call_per_group(fake_op, H, H_kv):
    q, k_cache, block_table, lens = _inputs(H=H, H_kv=H_kv, dtype=torch.float16)     # exact integers to 2048
    for h in range(H):
        q[:, :, h] = h
    for g in range(H_kv):
        k_cache[0, 0, g] = 256 * g
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, causal=True,
                                                softmax_scale=0.5, max_seqlen_k=7)
    G = H // H_kv
    assert len(fake_op) == H_kv
    for g, (seen_q, seen_kv, kwargs) in enumerate(fake_op):
        # strided views, no copies: query heads g*G .. g*G+G-1 and KV head g
        assert seen_q.shape == (2, 2, G, 576) and seen_q.data_ptr() == q[:, :, g * G].data_ptr()
        assert seen_q.stride() == q.stride()
        assert seen_kv.shape == (4, 64, 576) and seen_kv.data_ptr() == k_cache[:, :, g].data_ptr()
        assert seen_kv.stride() == (64 * H_kv * 576, H_kv * 576, 1)
        assert kwargs == dict(softmax_scale=0.5, causal=True, return_lse=True, head_dim_v=512, max_seqlen_k=7,
                              attn_sink=None)
    expected = torch.tensor([h + 256 * (h // G) for h in range(H)], dtype=torch.float32)
    assert out.shape == (2, 2, H, 512) and lse.shape == (2, H, 2)
    assert torch.equal(out[1, :, :, 0].float(), expected.expand(2, H))
    assert torch.equal(out[1, 1, :, 511].float(), expected)
    assert torch.equal(lse[1], expected[:, None].expand(H, 2))
    assert (lse[0] == math.inf).all()
    assert meta.config == flash_mla.SchedConfig(b=2, s_q=2, h_q=H, page_block_size=64, h_k=H_kv, causal=True,
                                                is_fp8_kvcache=False, topk=None)


@pytest.mark.parametrize("H, H_kv", [(9, 2), (3, 8), (63, 2)])
def test_query_heads_must_be_a_multiple_of_kv_heads(fake_op, H, H_kv):
    q, k_cache, block_table, lens = _inputs(H=H, H_kv=H_kv)
    with pytest.raises(InputError, match=rf"^q.shape\[2\]: got {H}, expected a multiple of k_cache.shape\[2\]={H_kv}"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, None)
    assert fake_op == []


@pytest.mark.parametrize("name", EXTRA)
def test_extra_cache_arguments_need_indices(fake_op, name):
    q, k_cache, block_table, lens = _inputs()
    value = torch.zeros(2, 2, 8, dtype=torch.int32)
    with pytest.raises(InputError, match=rf"^{name}: got Tensor, expected None without indices"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, None, **{name: value})
    assert fake_op == []


def test_extra_cache_reaches_the_op_as_the_same_bytes(fake_op):
    """FlashMLA's extra cache, its indices and lengths go to the op with the main cache's: the
    extra rows as a uint8 view of the same bytes (its own page size), the indices as given."""
    q, rows, indices = _flashmla_sparse_inputs()
    extra = torch.zeros(4, 32, 1, 656, dtype=torch.float8_e4m3fn)
    extra_indices = torch.zeros(3, 2, 16, dtype=torch.int32)
    extra_length = torch.tensor([16, 0, 5], dtype=torch.int32)
    flash_mla.flash_mla_with_kvcache(q, rows, None, None, 512, None, None, 0.25, False, True, indices,
                                     None, extra, extra_indices, None, extra_length)
    (_, _, kwargs), = fake_op
    seen = kwargs.pop("extra_kv_cache")
    assert seen.dtype == torch.uint8 and seen.data_ptr() == extra.data_ptr() and seen.shape == extra.shape
    assert kwargs.pop("extra_indices") is extra_indices and kwargs.pop("extra_topk_length") is extra_length
    with pytest.raises(InputError, match=r"^extra_k_cache: got torch.bfloat16 \(4, 32, 1, 576\), expected uint8 rows"):
        flash_mla.flash_mla_with_kvcache(q, rows, None, None, 512, None, None, 0.25, False, True, indices, None,
                                         torch.zeros(4, 32, 1, 576, dtype=torch.bfloat16), extra_indices)
    with pytest.raises(InputError, match=r"^extra_k_cache.shape: got \(4, 32, 2, 656\), expected k_cache's 1 KV head"):
        flash_mla.flash_mla_with_kvcache(q, rows, None, None, 512, None, None, 0.25, False, True, indices, None,
                                         torch.zeros(4, 32, 2, 656, dtype=torch.float8_e4m3fn), extra_indices)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float8_e4m3fn])
def test_fp8_caches_pass_flashmlas_rows_to_the_op(fake_op, dtype):
    """is_fp8_kvcache=True takes FlashMLA's 656-byte rows in any of FlashMLA's three dtypes and
    passes them as uint8 views of the same bytes, per KV head; a cache that does not match the
    flag is named; a flat e4m3 cache (no kv_scale here) is not FlashMLA's."""
    q, _, block_table, lens = _inputs(H=16, H_kv=2)
    rows = torch.zeros(4, 64, 2, 656, dtype=dtype)
    meta, _ = flash_mla.get_mla_metadata(lens, 2 * 8, 2, 16, True)
    flash_mla.flash_mla_with_kvcache(q, rows, block_table, lens, 512, meta, is_fp8_kvcache=True)
    assert [(c[1].dtype, c[1].shape, c[1].stride()) for c in fake_op] == [(torch.uint8, (4, 64, 656),
                                                                           (64 * 2 * 656, 2 * 656, 1))] * 2
    assert [c[1].data_ptr() for c in fake_op] == [rows[:, :, 0].data_ptr(), rows[:, :, 1].data_ptr()]
    with pytest.raises(InputError, match=r"^k_cache: got torch.bfloat16 \(4, 64, 2, 576\), expected uint8 rows of 656"):
        flash_mla.flash_mla_with_kvcache(q, torch.zeros(4, 64, 2, 576, dtype=torch.bfloat16), block_table, lens,
                                         512, None, is_fp8_kvcache=True)
    with pytest.raises(InputError, match=rf"^is_fp8_kvcache: got False, expected True for a {dtype} k_cache of "
                                         r"FlashMLA's FP8 rows \(656 bytes\)"):
        flash_mla.flash_mla_with_kvcache(q, rows, block_table, lens, 512, None)
    with pytest.raises(NotImplementedError, match="a torch.float8_e4m3fn KV cache.*mlagen.verify_attention"):
        flash_mla.flash_mla_with_kvcache(q, torch.zeros(4, 64, 2, 576, dtype=torch.float8_e4m3fn), block_table,
                                         lens, 512, None)
    assert len(fake_op) == 2


@pytest.mark.parametrize("head_dim, row_bytes", [(512, 584), (512, 656), (576, 584)])
def test_flashmlas_d512_fp8_layout_is_refused(fake_op, head_dim, row_bytes):
    """FlashMLA's d_qk 512 FP8 rows (448 e4m3 + 64 bf16 rope dims, e8m0 scales: 584 bytes), told
    by q's width or the rows' bytes, raise NotImplementedError naming what was given and what
    mlagen takes, dense or sparse."""
    q = torch.zeros(2, 2, 64, head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 1, row_bytes, dtype=torch.float8_e4m3fn)
    message = (rf"FlashMLA's d_qk 512 FP8 layout \(q.shape\[-1\]={head_dim}, k_cache rows of {row_bytes} bytes: "
               r"448 e4m3 and 64 bf16 rope dims with e8m0 scales\); mlagen takes d_qk 576 with FP8 rows of 656 bytes")
    with pytest.raises(NotImplementedError, match=message):
        flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, None, None, None, False, True,
                                         torch.zeros(2, 2, 64, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match=message):
        flash_mla.flash_mla_with_kvcache(q, cache, *_inputs()[2:], 512, None, is_fp8_kvcache=True)
    assert fake_op == []


def _flashmla_sparse_inputs(B=3, S=2, H=64, topk=8, pages=5, page=61):
    """q, FP8 rows and indices as FlashMLA's sparse test makes them: q a strided view, the rows
    float8_e4m3fn [pages, page, 1, 656] with one spare row a page (a padded page stride), the
    indices [B, S, topk] a strided view with -1 in unused slots."""
    q = torch.zeros(B + 1, S + 1, H + 1, 576 + 128, dtype=torch.bfloat16)[:B, :S, :H, :576]
    rows = torch.zeros(pages, page + 1, 656, dtype=torch.float8_e4m3fn)[:, :page].view(pages, page, 1, 656)
    indices = torch.arange(B * S * topk, dtype=torch.int32).view(B, S, topk) % (pages * page)
    indices[:, :, -1] = -1
    strided = torch.zeros(B + 1, S + 1, topk + 128, dtype=torch.int32)[:B, :S, :topk]
    strided.copy_(indices)
    return q, rows, strided


def test_sparse_call_in_flashmlas_form_reaches_the_op(fake_op):
    """FlashMLA's sparse decode call, positional as its tests make it (block_table and
    cache_seqlens None, causal False, is_fp8_kvcache True, then indices, attn_sink, the extra
    cache's None, topk_length, extra_topk_length): one op call with the rows as a uint8 view
    of the same bytes and strides, the indices and topk_length as given, no block table or
    lengths, causal False; lse +inf for rows without keys; the metadata object bound to topk."""
    q, rows, indices = _flashmla_sparse_inputs()
    sink = torch.zeros(64)
    topk_length = torch.tensor([8, 3, 0], dtype=torch.int32)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, rows, None, None, 512, meta, None, 0.25, False, True, indices,
                                                sink, None, None, topk_length, None)
    (seen_q, seen_kv, kwargs), = fake_op
    assert fake_op.paged == [(None, None)]
    assert seen_q is q
    assert seen_kv.dtype == torch.uint8 and seen_kv.shape == rows.shape and seen_kv.stride() == rows.stride()
    assert seen_kv.data_ptr() == rows.data_ptr()
    assert kwargs.pop("indices") is indices and kwargs.pop("topk_length") is topk_length
    assert kwargs.pop("attn_sink") is sink
    assert kwargs.pop("extra_indices") is None and kwargs.pop("extra_topk_length") is None
    assert kwargs == dict(softmax_scale=0.25, causal=False, return_lse=True, head_dim_v=512)
    assert out.shape == (3, 2, 64, 512) and lse.shape == (3, 64, 2)
    assert (lse[0] == math.inf).all() and (out[0] == 0).all() and (lse[1:] == 0).all()
    assert meta.config == flash_mla.SchedConfig(b=3, s_q=2, h_q=64, page_block_size=61, h_k=1, causal=False,
                                                is_fp8_kvcache=True, topk=8)


def test_sparse_defaults_and_bf16_caches(fake_op):
    """FlashMLA's default scale (576 ** -0.5) and topk_length None reach the op; a bf16 cache
    (which FlashMLA's sparse path refuses) passes as given; the placeholder metadata of the
    older form with topk is accepted."""
    q, _, indices = _flashmla_sparse_inputs(B=2)
    cache = torch.zeros(5, 61, 576, dtype=torch.bfloat16)
    metadata, splits = flash_mla.get_mla_metadata(torch.ones(2, dtype=torch.int32), 2 * 64, 1, 64, False, 8)
    flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, metadata, splits, indices=indices)
    (_, seen_kv, kwargs), = fake_op
    assert seen_kv is cache
    assert kwargs == dict(softmax_scale=576 ** -0.5, causal=False, return_lse=True, head_dim_v=512, indices=indices,
                          topk_length=None, attn_sink=None, extra_indices=None, extra_topk_length=None)


def test_sparse_with_several_kv_heads_runs_one_call_per_group(fake_op):
    """Every KV head's group reads the same row ids, each from its own head's view."""
    q, _, indices = _flashmla_sparse_inputs(B=2, H=8)
    cache = torch.zeros(5, 61, 2, 576, dtype=torch.bfloat16)
    flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, None, indices=indices)
    assert [c[1].data_ptr() for c in fake_op] == [cache[:, :, 0].data_ptr(), cache[:, :, 1].data_ptr()]
    assert [c[0].shape for c in fake_op] == [(2, 2, 4, 576)] * 2
    assert all(c[2]["indices"] is indices for c in fake_op)


@pytest.mark.parametrize("change, message", [
    (dict(causal=True), r"^causal: got True, expected False with indices \(sparse attention has no mask\)"),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)),
     r"^block_table: got Tensor, expected None with indices \(sparse attention reads the rows indices lists\)"),
    (dict(cache_seqlens=torch.ones(3, dtype=torch.int32)), r"^cache_seqlens: got Tensor, expected None with indices"),
    (dict(max_seqlen_k=64), r"^max_seqlen_k: got int, expected None with indices"),
    (dict(indices=[[0]]), r"^indices: got list, expected an int32 torch.Tensor \[B, S, topk\] or None"),
])
def test_sparse_call_errors_name_the_argument(fake_op, change, message):
    q, rows, indices = _flashmla_sparse_inputs()
    call = {**dict(block_table=None, cache_seqlens=None, is_fp8_kvcache=True, indices=indices), **change}
    with pytest.raises(InputError, match=message):
        flash_mla.flash_mla_with_kvcache(q, rows, head_dim_v=512, tile_scheduler_metadata=None, **call)
    assert fake_op == []


def test_topk_length_needs_indices(fake_op):
    q, k_cache, block_table, lens = _inputs()
    with pytest.raises(InputError, match=r"^topk_length: got Tensor, expected None without indices"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, None, topk_length=lens)
    assert fake_op == []


def test_sched_meta_binds_sparse_configuration(fake_op):
    """A FlashMLASchedMeta first used sparse refuses another topk, a dense call, and an FP8 flag
    that changed, naming each; the same topk with other row ids and lengths is fine."""
    q, rows, indices = _flashmla_sparse_inputs()
    meta, _ = flash_mla.get_mla_metadata()
    flash_mla.flash_mla_with_kvcache(q, rows, None, None, 512, meta, is_fp8_kvcache=True, indices=indices)
    flash_mla.flash_mla_with_kvcache(q, rows, None, None, 512, meta, is_fp8_kvcache=True, indices=indices.flip(-1),
                                     topk_length=torch.ones(3, dtype=torch.int32))
    prefix = r"^tile_scheduler_metadata: got a FlashMLASchedMeta first used with another configuration \("
    _, wider, more = _flashmla_sparse_inputs(topk=16)
    with pytest.raises(InputError, match=prefix + r"topk \(indices.shape\[-1\]\) 8 -> 16\)"):
        flash_mla.flash_mla_with_kvcache(q, rows, None, None, 512, meta, is_fp8_kvcache=True, indices=more)
    bf16 = torch.zeros(5, 61, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=prefix + r"is_fp8_kvcache True -> False\)"):
        flash_mla.flash_mla_with_kvcache(q, bf16, None, None, 512, meta, indices=indices)
    with pytest.raises(InputError, match=prefix + r"is_fp8_kvcache True -> False, topk \(indices.shape\[-1\]\) "
                                                  r"8 -> None\)"):
        flash_mla.flash_mla_with_kvcache(q, bf16, torch.zeros(3, 2, dtype=torch.int32),
                                         torch.ones(3, dtype=torch.int32), 512, meta)
    assert len(fake_op) == 2


def test_sched_meta_records_its_first_configuration(fake_op):
    meta, _ = flash_mla.get_mla_metadata()
    q, k_cache, block_table, lens = _inputs(H=16, H_kv=2)
    flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, None, causal=True)
    assert meta.have_initialized
    assert meta.config == flash_mla.SchedConfig(b=2, s_q=2, h_q=16, page_block_size=64, h_k=2, causal=True,
                                                is_fp8_kvcache=False, topk=None)
    # the same configuration again, with other values, scale and pages: fine
    q2, k2, bt2, lens2 = _inputs(H=16, H_kv=2, pages=9)
    flash_mla.flash_mla_with_kvcache(q2, k2, bt2, lens2 + 5, 512, meta, None, 0.1, True)
    assert len(fake_op) == 4


@pytest.mark.parametrize("changes, message", [
    (dict(B=3), r"batch size \(q.shape\[0\]\) 2 -> 3"),
    (dict(S=4), r"seq_len_q \(q.shape\[1\]\) 2 -> 4"),
    (dict(H=32), r"num_heads_q \(q.shape\[2\]\) 16 -> 32"),
    (dict(page=16), r"page_block_size \(k_cache.shape\[1\]\) 64 -> 16"),
    (dict(H_kv=1), r"num_heads_k \(k_cache.shape\[2\]\) 2 -> 1"),
    (dict(causal=False), r"\(causal True -> False\)"),
    (dict(B=1, H_kv=4), r"\(batch size \(q.shape\[0\]\) 2 -> 1, num_heads_k \(k_cache.shape\[2\]\) 2 -> 4\)"),
])
def test_reused_sched_meta_names_what_changed(fake_op, changes, message):
    meta, _ = flash_mla.get_mla_metadata()
    q, k_cache, block_table, lens = _inputs(H=16, H_kv=2)
    flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, causal=True)
    causal = changes.pop("causal", True)
    q, k_cache, block_table, lens = _inputs(**{"H": 16, "H_kv": 2, **changes})
    with pytest.raises(InputError, match=r"^tile_scheduler_metadata: got a FlashMLASchedMeta first used with another "
                                         r"configuration .*" + message + r".*call get_mla_metadata\(\) for each"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, causal=causal)
    assert len(fake_op) == 2


def test_older_metadata_forms_are_accepted(fake_op):
    q, k_cache, block_table, lens = _inputs(H=16, H_kv=2)
    metadata, splits = flash_mla.get_mla_metadata(lens, 2 * 8, 2, 16)
    flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, metadata, splits)
    flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, metadata)           # num_splits None
    flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, metadata, splits)   # reused: no record
    assert len(fake_op) == 6


def test_metadata_misuse(fake_op):
    q, k_cache, block_table, lens = _inputs()
    _, splits = flash_mla.get_mla_metadata(torch.ones(5, dtype=torch.int32), 32, 1)
    with pytest.raises(InputError, match=r"^num_splits.shape: got \(6,\), expected \[batch_size \+ 1\]=\[3\]"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, None, splits)
    with pytest.raises(InputError, match=r"^num_splits: got int"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, None, 3)
    with pytest.raises(InputError, match=r"^tile_scheduler_metadata: got tuple, expected what "
                                         r"mlagen.compat.flash_mla.get_mla_metadata returns"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, flash_mla.get_mla_metadata())
    assert fake_op == []


def test_bool_softmax_scale_is_refused(fake_op):
    # FlashMLA's README passes is_causal in softmax_scale's place; FlashMLA would use 1.0 (or 0.0).
    q, k_cache, block_table, lens = _inputs()
    with pytest.raises(InputError, match=r"^softmax_scale: got True, expected a float or None"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, None, None, True, False)
    assert fake_op == []


@pytest.mark.parametrize("sink, message", [
    (torch.zeros(16, dtype=torch.bfloat16), r"^attn_sink.dtype: got torch.bfloat16, expected torch.float32"),
    (torch.zeros(16, dtype=torch.float64), r"^attn_sink.dtype: got torch.float64, expected torch.float32"),
    (torch.zeros(8), r"^attn_sink.shape: got \(8,\), expected \(16,\): one sink per query head"),
    (torch.zeros(1, 16), r"^attn_sink.shape: got \(1, 16\), expected \(16,\): one sink per query head"),
    (torch.zeros(16, device="meta"), r"^attn_sink.device: got meta, expected cpu, where q is"),
    ([0.0] * 16, r"^attn_sink: got list, expected None or a torch.Tensor \[16\] float32"),
])
def test_attn_sink_argument_errors(fake_op, sink, message):
    q, k_cache, block_table, lens = _inputs()
    with pytest.raises(InputError, match=message):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, None, attn_sink=sink)
    assert fake_op == []


def _sink_factor(lse: float, sink: float) -> float:
    """FlashMLA's definition, exp(lse) / (exp(lse) + exp(sink)), in Python floats (fp64); a row
    that sees no key (lse -inf) stays 0."""
    if lse == -math.inf:
        return 0.0
    return math.exp(lse) / (math.exp(lse) + math.exp(sink))


def test_attn_sink_math_against_fp64_formula():
    B, S, H, D = 3, 2, 5, 7
    gen = torch.Generator().manual_seed(0)
    lse = torch.randn(B, H, S, generator=gen, dtype=torch.float64) * 4
    lse[1, :, 0] = -math.inf                                  # rows that see no key
    lse[2, 3, 1] = -math.inf
    sink = torch.tensor([0.5, math.inf, -math.inf, -3.0, 2.0], dtype=torch.float64)
    out = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
    out[1, 0] = 0.0
    out[2, 1, 3] = 0.0
    expected = out.clone()
    for b in range(B):
        for i in range(S):
            for h in range(H):
                expected[b, i, h] *= _sink_factor(float(lse[b, h, i]), float(sink[h]))
    got = sinks.apply_attn_sink_(out.clone(), lse.transpose(1, 2), sink)
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=0)
    assert (got[:, :, 1] == 0).all()                          # sink +inf: 0
    assert torch.equal(got[0, :, 2], out[0, :, 2])            # sink -inf: unchanged
    assert (got[1, 0] == 0).all() and not got.isnan().any()   # empty rows stay 0, with any sink

    # fp32 lse and sink, bf16 out, in place: the product is rounded once to bf16
    out16 = out.to(torch.bfloat16)
    result = sinks.apply_attn_sink_(out16, lse.float().transpose(1, 2), sink.float())
    assert result is out16
    reference = out.to(torch.bfloat16).double() * (expected / out).nan_to_num(0.0)
    torch.testing.assert_close(out16.double(), reference, rtol=2**-8, atol=0)


def test_attn_sink_is_stable_for_large_lse():
    lse = torch.tensor([1e4, -1e4, 80.0, 1e4]).view(1, 4, 1)    # B=1, H=4, S=1
    sink = torch.tensor([1e4 + 1, 1e4, 100.0, -math.inf])
    out = sinks.apply_attn_sink_(torch.ones(1, 1, 4, 3), lse.transpose(1, 2), sink)
    expected = torch.tensor([1 / (1 + math.e), 0.0, 1 / (1 + math.exp(20.0)), 1.0])
    torch.testing.assert_close(out[0, 0, :, 0], expected, rtol=1e-6, atol=0)
    assert torch.isfinite(out).all()


def test_attn_sink_through_the_compat_call(fake_op):
    """lse returned unscaled (+inf for empty rows), out scaled per query head with its sink."""
    q, k_cache, block_table, lens = _inputs(H=4, H_kv=2)
    for h in range(4):
        q[:, :, h] = h                                        # lse = h (KV heads' first elements are 0)
    sink = torch.tensor([0.0, math.inf, -math.inf, 1.5])
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, None, attn_sink=sink)
    factor = torch.tensor([_sink_factor(h, float(sink[h])) for h in range(4)])
    assert torch.equal(lse[1], torch.arange(4.0)[:, None].expand(4, 2))
    assert (lse[0] == math.inf).all() and (out[0] == 0).all()
    expected = (torch.arange(4.0) * factor).to(torch.bfloat16)
    assert torch.equal(out[1, 1, :, 0], expected) and torch.equal(out[1, 0, :, 100], expected)


def _meta_inputs(B=2, S=3, H=8, H_kv=2):
    q, k_cache, block_table, lens = _inputs(B=B, S=S, H=H, H_kv=H_kv, device="meta")
    return q, k_cache, block_table, lens, torch.zeros(H, device="meta")


@pytest.mark.parametrize("H, H_kv", [(8, 1), (8, 2), (9, 3)])
def test_real_op_on_meta_tensors(H, H_kv):
    """The registered op on meta tensors (its fake implementation): the shapes of out and lse
    with several KV heads and a sink, and no value is read back (meta tensors have none)."""
    q, k_cache, block_table, lens, sink = _meta_inputs(H=H, H_kv=H_kv)
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, flash_mla.get_mla_metadata()[0],
                                                causal=True, attn_sink=sink)
    assert out.shape == (2, 3, H, 512) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert lse.shape == (2, H, 3) and lse.dtype == torch.float32


def test_traces_in_one_graph_under_torch_compile():
    """torch.compile(fullgraph=True) on meta tensors: the metadata check, one op call per KV
    head, the join and the sink make one graph (no breaks); a later call with another batch
    size on the same metadata object raises."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    meta, _ = flash_mla.get_mla_metadata()

    def step(q, k_cache, block_table, lens, sink):
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, causal=True, attn_sink=sink)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    out, lse = compiled(*_meta_inputs(H=8, H_kv=2))
    assert out.shape == (2, 3, 8, 512) and lse.shape == (2, 8, 3)
    assert len(graphs) == 1
    ops = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "mlagen" in str(n.target)]
    assert len(ops) == 2
    assert meta.config == flash_mla.SchedConfig(b=2, s_q=3, h_q=8, page_block_size=64, h_k=2, causal=True,
                                                is_fp8_kvcache=False, topk=None)
    # torch.compile(fullgraph=True) reports the InputError inside its own error
    with pytest.raises(Exception, match=r"batch size \(q.shape\[0\]\) 2 -> 3"):
        compiled(*_meta_inputs(B=3, H=8, H_kv=2))


def test_gpu_grid_covers_every_value_of_each_axis():
    """tests/test_gpu_dropin.py's sample of FlashMLA's dense-decoding grid: every value of every
    axis, every (H_q, H_kv) pair with H_q % H_kv == 0; the zero-length cases every pair too, with
    and without causal; few enough cases for a GPU run of a minute or two."""
    axes = grid_axes()
    for name, values in axes.items():
        assert {getattr(c, name) for c in FLASH_MLA_GRID} == set(values), name
    pairs = {(h, k) for h in axes["h_q"] for k in axes["h_kv"] if h % k == 0}
    assert len(pairs) == 16
    assert {(c.h_q, c.h_kv) for c in FLASH_MLA_GRID} == pairs
    assert {(c.h_q, c.h_kv) for c in FLASH_MLA_ZERO_LENGTH} == pairs
    assert {c.causal for c in FLASH_MLA_ZERO_LENGTH} == {False, True}
    assert all((c.b, c.s_q, c.s_k, c.varlen, c.zero_lengths) == (128, 2, 4096, True, True)
               for c in FLASH_MLA_ZERO_LENGTH)
    assert len({c.id for c in FLASH_MLA_GRID + FLASH_MLA_ZERO_LENGTH}) == len(FLASH_MLA_GRID + FLASH_MLA_ZERO_LENGTH)
    assert len(FLASH_MLA_GRID) + len(FLASH_MLA_ZERO_LENGTH) <= 160


class _Planned(Exception):
    """Raised by the stand-in planner: the plan was made, and nothing was launched."""


@pytest.fixture
def planner(monkeypatch):
    """The real op and host path on CPU tensors, up to the plan: records the query heads and
    KV capacity each plan is made for (`op._prepare`'s heads and kv_capacity), then stops
    before any launch."""
    plans = []

    def prepare(heads, dl, dr, dtype, page_size, mask, lse, batch, seqlen_q, kv_capacity, *rest, **options):
        plans.append((heads, kv_capacity))
        raise _Planned

    monkeypatch.setattr(op, "_calls", {})
    monkeypatch.setattr(op, "_require_cuda", lambda q: None)
    monkeypatch.setattr(op, "_prepare", prepare)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return plans


def _wide_table_call(heads_k=1, **kwargs):
    """One request of S=9 and 300 keys under a table of 2048 pages of 64 (131072 keys), the
    H200 benchmark's wide table."""
    q = torch.zeros(1, 9, 16, 576, dtype=torch.bfloat16)
    k_cache = torch.zeros(8, 64, heads_k, 576, dtype=torch.bfloat16)
    block_table = torch.zeros(1, 2048, dtype=torch.int32)
    cache_seqlens = torch.full((1,), 300, dtype=torch.int32)
    return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, None, None,
                                            causal=True, **kwargs)


def test_max_seqlen_k_reaches_the_op(fake_op):
    _wide_table_call(max_seqlen_k=300)
    assert fake_op[0][2]["max_seqlen_k"] == 300
    with pytest.raises(TypeError):    # keyword-only: FlashMLA's positional arguments end at extra_topk_length
        flash_mla.flash_mla_with_kvcache(*([None] * 16), 300)


def test_max_seqlen_k_plans_for_the_bound_not_the_table(planner):
    """Through the registered op into the host path: the plan is made for the table's capacity
    without a bound, for the bound (a quarter octave up) with one."""
    with pytest.raises(_Planned):
        _wide_table_call()
    with pytest.raises(_Planned):
        _wide_table_call(max_seqlen_k=300)
    with pytest.raises(_Planned):
        _wide_table_call(max_seqlen_k=20)
    assert [c for _, c in planner] == [2048 * 64, inputs.key_bound(300), 64]
    assert 300 <= planner[1][1] < 2048 * 64


def test_kv_head_views_pass_the_ops_checks(planner):
    """A KV head's strided view of k_cache [pages, 64, 4, 576] and its query heads' view of q
    pass the op's argument checks (strides and alignment) and reach the plan, for 16 / 4 heads."""
    with pytest.raises(_Planned):
        _wide_table_call(heads_k=4)
    assert planner == [(4, 2048 * 64)]


@pytest.mark.parametrize("bad", [-1, "4096", 4096.0, True])
def test_bad_max_seqlen_k_raises_before_any_plan(planner, bad):
    # Checked before the op (`verify_attention_op`): through the op's schema a bool would arrive
    # as 1 and a str or float would raise torch's RuntimeError instead.
    with pytest.raises(InputError, match=f"^max_seqlen_k: got {bad!r}, expected None or an int >= 0"):
        _wide_table_call(max_seqlen_k=bad)
    assert planner == []
