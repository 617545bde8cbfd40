"""The FP8 KV cache formats (`mlagen.runtime.kv_formats`): round trips within e4m3's rounding,
DeepSeek's 656-byte rows decoded by hand, the scale rules, every argument check, and the
reference on FP8 caches: equal to the reference on the dequantized cache, and blind to whatever
lies in unused pages, rows past each length and their scale bytes."""

from __future__ import annotations

import dataclasses
import math
import re
import struct

import pytest
import torch

import mlagen
from mlagen import InputError, KVFormat, dequantize_kv, kv_format_of, quantize_kv
from mlagen.runtime.kv_formats import (
    DS_MLA_MIN_SCALE,
    E4M3_MAX,
    GROUP_DIM,
    GROUPS,
    LATENT_DIM,
    ROPE_AT,
    ROW_DIM,
    SCALES_AT,
    dequantize_e4m3,
)
from mlagen.runtime.reference import reference, reference_naive
from mlagen.tools.testing import make_case

E4M3_MIN_NORMAL = 2.0 ** -6          # below it e4m3 is subnormal, in steps of 2^-9
LAYOUTS = ("e4m3", "ds_mla")


def _cache(pages: int = 3, page_size: int = 4, magnitude: float = 1.0, seed: int = 0,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(pages, page_size, ROW_DIM, generator=gen) * magnitude).to(dtype)


def _e4m3_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 step at each value x (fp64), stored as x / scale: 2^-4 of |x| where x / scale
    is normal (a relative step of 2^-3), half the subnormal step 2^-9 (times the scale) below;
    with slack for the fp32 division and product around the rounding."""
    stored = (x / scale).abs()
    half_step = torch.where(stored >= E4M3_MIN_NORMAL, stored * 2.0 ** -4, torch.full_like(stored, 2.0 ** -10))
    return half_step * scale * (1 + 2.0 ** -18)


def _group_scales(x: torch.Tensor) -> torch.Tensor:
    """FlashMLA's rule for ds_mla, in fp64: 2^ceil(log2(max(amax / 448, 1e-4))) per 128 latent dims."""
    amax = x[..., :LATENT_DIM].double().unflatten(-1, (GROUPS, GROUP_DIM)).abs().amax(-1)
    return torch.exp2(torch.ceil(torch.log2((amax / E4M3_MAX).clamp_min(DS_MLA_MIN_SCALE))))


# Rows of several kinds: ordinary values at three magnitudes, zeros, one huge value among small
# ones, and values so small that they fall into e4m3's subnormal range.
def _rows_of_every_kind(dtype: torch.dtype) -> torch.Tensor:
    x = _cache(pages=6, page_size=4, dtype=torch.float32)
    x[0] *= 1e-3
    x[1] *= 1e3
    x[2] = 0.0
    x[3, :, 7] = 3e4                      # one huge value per row, in the first latent group
    x[4] *= 1e-7                          # subnormal in e4m3 at ds_mla's smallest scale
    x[5, :, :LATENT_DIM] *= 1e-2          # latent small, rope ordinary
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_e4m3_round_trip(dtype):
    """Per-tensor scale from the amax: every value back within half an e4m3 step, zeros exact."""
    x = _rows_of_every_kind(dtype)
    quantized, scale = quantize_kv(x, "e4m3")
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (1,) and scale.device == x.device
    assert float(scale) == pytest.approx(float(x.float().abs().max()) / E4M3_MAX, rel=1e-6)
    back = dequantize_kv(quantized, "e4m3", scale, dtype=torch.float64)
    err = (back - x.double()).abs()
    assert (err <= _e4m3_error_bound(x.double(), float(scale))).all()
    assert (back[x == 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ds_mla_round_trip(dtype):
    """Per-row group scales: latent values back within half an e4m3 step of their group's scale,
    bf16 rope dims exactly (rounded to bf16 from fp32), zero rows exactly zero."""
    x = _rows_of_every_kind(dtype)
    quantized, scale = quantize_kv(x, "ds_mla")
    assert scale is None and quantized.dtype == torch.uint8 and quantized.shape == (*x.shape[:-1], 656)
    back = dequantize_kv(quantized, "ds_mla", dtype=torch.float64)
    latent = x[..., :LATENT_DIM].double().unflatten(-1, (GROUPS, GROUP_DIM))
    err = (back[..., :LATENT_DIM].unflatten(-1, (GROUPS, GROUP_DIM)) - latent).abs()
    assert (err <= _e4m3_error_bound(latent, _group_scales(x)[..., None])).all()
    assert torch.equal(back[..., LATENT_DIM:], x[..., LATENT_DIM:].to(torch.bfloat16).double())
    assert (back[2] == 0).all()
    # the huge value sets only its own group's scale: the other groups keep theirs
    huge_row = quantized[3, :, SCALES_AT:ROPE_AT].contiguous().view(torch.float32)
    assert (huge_row[:, 0] == 128).all() and (huge_row[:, 1:] <= 2.0 ** -5).all()


def test_ds_mla_scales_follow_flash_mla():
    """Each group's scale is amax / 448 raised to 1e-4 and rounded up to a power of two: so the
    group's largest value lands in (224, 448], and zero or tiny groups get 2^-13."""
    x = _rows_of_every_kind(torch.bfloat16)
    quantized, _ = quantize_kv(x, "ds_mla")
    scales = quantized[..., SCALES_AT:ROPE_AT].contiguous().view(torch.float32).double()
    assert torch.equal(scales, _group_scales(x))
    assert (scales[2] == 2.0 ** -13).all() and (scales[4] == 2.0 ** -13).all()
    amax = x[..., :LATENT_DIM].double().unflatten(-1, (GROUPS, GROUP_DIM)).abs().amax(-1)
    big = amax / E4M3_MAX > DS_MLA_MIN_SCALE
    ratio = (amax / scales)[big]
    assert ((ratio > E4M3_MAX / 2) & (ratio <= E4M3_MAX)).all()


def _e4m3_by_hand(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def test_ds_mla_bytes_decoded_by_hand():
    """One row's 656 bytes, read with struct: 512 e4m3 bytes, four little-endian fp32 scales at
    512-527 (group g for latent dims 128g..128g+127), 64 little-endian bf16 rope values at 528-655."""
    x = _rows_of_every_kind(torch.bfloat16)
    quantized, _ = quantize_kv(x, "ds_mla")
    back = dequantize_kv(quantized, "ds_mla")
    for page, row in [(0, 1), (3, 2), (5, 0)]:
        raw = bytes(quantized[page, row].tolist())
        assert len(raw) == 656
        scales = struct.unpack("<4f", raw[512:528])
        assert scales == tuple(_group_scales(x)[page, row].tolist())
        rope = [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(528, 656, 2)]
        assert rope == x[page, row, LATENT_DIM:].float().tolist()
        latent = [_e4m3_by_hand(b) * scales[d // GROUP_DIM] for d, b in enumerate(raw[:512])]
        assert latent == back[page, row, :LATENT_DIM].tolist()


def test_e4m3_bytes_are_the_values_over_the_scale():
    x = _cache(magnitude=5.0)
    quantized, scale = quantize_kv(x, "e4m3", kv_scale=0.25)
    assert scale == 0.25
    by_hand = [_e4m3_by_hand(b) for b in quantized.view(torch.uint8).flatten().tolist()]
    rounded = (x.float().flatten() / 0.25).to(torch.float8_e4m3fn).float()
    assert by_hand == rounded.tolist() == (dequantize_kv(quantized, "e4m3", 0.25).flatten() / 0.25).tolist()


@pytest.mark.parametrize("scale_shape", [(), (1,), (1, 1)])
def test_scale_as_float_or_tensor(scale_shape):
    """A float and a one-element fp32 tensor of any shape give the same bytes and values, and
    the output keeps the cache's shape (no dims from the scale)."""
    x = _cache(magnitude=3.0)
    as_float, _ = quantize_kv(x, "e4m3", kv_scale=0.125)
    tensor = torch.full(scale_shape, 0.125)
    as_tensor, returned = quantize_kv(x, "e4m3", kv_scale=tensor)
    assert returned is tensor and torch.equal(as_float.view(torch.uint8), as_tensor.view(torch.uint8))
    assert torch.equal(dequantize_kv(as_float, "e4m3", 0.125), dequantize_kv(as_tensor, "e4m3", tensor))
    # a new scale in the same tensor: the same call computes with it
    tensor.fill_(0.25)
    assert torch.equal(dequantize_kv(as_tensor, "e4m3", tensor), 2 * dequantize_kv(as_float, "e4m3", 0.125))


def test_saturation_and_nan():
    """Values beyond 448 x scale saturate to +-448; NaN stays NaN; the picked scale ignores
    non-finite values."""
    x = torch.zeros(1, 2, ROW_DIM)
    x[0, 0, :4] = torch.tensor([1e6, -1e6, math.inf, 2.0])
    x[0, 1, 0] = math.nan
    quantized, _ = quantize_kv(x, "e4m3", kv_scale=1.0)
    assert quantized[0, 0, :4].float().tolist() == [448.0, -448.0, 448.0, 2.0]
    assert math.isnan(float(quantized[0, 1, 0].float()))
    _, picked = quantize_kv(x, "e4m3")
    assert float(picked) == pytest.approx(1e6 / E4M3_MAX)
    ds, _ = quantize_kv(x, "ds_mla")
    assert struct.unpack("<f", bytes(ds[0, 1, 512:516].tolist()))[0] == 2.0 ** -13


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_dim_of_one(layout):
    """A [num_pages, page_size, 1, 576] cache keeps its 1 when quantized; dequantizing gives
    [num_pages, page_size, 576]."""
    x = _cache()
    quantized, scale = quantize_kv(x[:, :, None], layout)
    assert quantized.shape[:3] == (*x.shape[:2], 1)
    assert kv_format_of(quantized, scale).name == layout
    assert torch.equal(dequantize_kv(quantized, layout, scale), dequantize_kv(quantize_kv(x, layout)[0], layout, scale))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_host_reads(layout):
    """quantize_kv, dequantize_kv and kv_format_of (without check_values) run on meta tensors,
    which have no values to read: nothing in them reads the device."""
    x = torch.empty(3, 4, ROW_DIM, dtype=torch.bfloat16, device="meta")
    quantized, scale = quantize_kv(x, layout)
    assert quantized.device.type == "meta"
    assert kv_format_of(quantized, scale).name == layout
    assert dequantize_kv(quantized, layout, scale).shape == (3, 4, ROW_DIM)


def test_formats_named():
    x = _cache()
    named = {kv_format_of(x).name: kv_format_of(x), kv_format_of(x.half()).name: kv_format_of(x.half())}
    for layout in LAYOUTS:
        quantized, scale = quantize_kv(x, layout)
        named[layout] = kv_format_of(quantized, scale)
    assert {n: f.row_bytes for n, f in named.items()} == {"bf16": 1152, "fp16": 1152, "e4m3": 576, "ds_mla": 656}
    assert [f.kv_scale for f in named.values()] == [False, False, True, False]
    assert isinstance(named["e4m3"], KVFormat)
    with pytest.raises(dataclasses.FrozenInstanceError):
        named["e4m3"].name = "other"
    assert kv_format_of(torch.zeros(2, 4, 320, dtype=torch.bfloat16)).name == "bf16"   # 16-bit: any width


_E4M3 = torch.zeros(2, 4, ROW_DIM, dtype=torch.float8_e4m3fn)
_DS = torch.zeros(2, 4, 656, dtype=torch.uint8)
_BF16 = torch.zeros(2, 4, ROW_DIM, dtype=torch.bfloat16)

# (call, the argument its message names first, the rest of the message's start)
BAD_CALLS = [
    (lambda: kv_format_of([1, 2]), "kv_cache", "got list, expected a torch.Tensor"),
    (lambda: kv_format_of(_BF16.float()), "kv_cache.dtype", "got torch.float32, expected one of torch.bfloat16"),
    (lambda: kv_format_of(torch.zeros(2, 4, 2, 576, dtype=torch.bfloat16)), "kv_cache.shape", "got (2, 4, 2, 576)"),
    (lambda: kv_format_of(torch.zeros(2, 4, 576, dtype=torch.uint8)), "kv_cache.shape[-1]", "got 576, expected 656"),
    (lambda: kv_format_of(_E4M3[..., :512], 1.0), "kv_cache.shape[-1]", "got 512, expected 576"),
    (lambda: kv_format_of(_E4M3), "kv_scale", "got None, expected a float or a one-element torch.float32"),
    (lambda: kv_format_of(_E4M3, "1.0"), "kv_scale", "got str, expected a float"),
    (lambda: kv_format_of(_E4M3, torch.ones(1, dtype=torch.float16)), "kv_scale",
     "got a torch.float16 tensor of shape (1,), expected"),
    (lambda: kv_format_of(_E4M3, torch.ones(2)), "kv_scale", "got a torch.float32 tensor of shape (2,)"),
    (lambda: kv_format_of(_E4M3, torch.ones(1, device="meta")), "kv_scale",
     "got a tensor on meta, expected a float or a one-element torch.float32 tensor on cpu"),
    (lambda: kv_format_of(_E4M3, math.nan), "kv_scale", "got nan, expected a finite scale > 0"),
    (lambda: kv_format_of(_E4M3, math.inf), "kv_scale", "got inf, expected a finite scale > 0"),
    (lambda: kv_format_of(_E4M3, 0.0), "kv_scale", "got 0.0, expected a finite scale > 0"),
    (lambda: kv_format_of(_E4M3, -2), "kv_scale", "got -2.0, expected a finite scale > 0"),
    (lambda: kv_format_of(_E4M3, torch.zeros(1), check_values=True), "kv_scale", "got 0.0, expected a finite"),
    (lambda: kv_format_of(_E4M3, torch.full((), math.nan), check_values=True), "kv_scale", "got nan"),
    (lambda: kv_format_of(_BF16, 1.0), "kv_scale", "got a float, expected None for a torch.bfloat16 cache"),
    (lambda: kv_format_of(_DS, torch.ones(1)), "kv_scale", "got a Tensor, expected None for a torch.uint8 cache"),
    (lambda: quantize_kv(_BF16, "fp8"), "layout", "got 'fp8', expected 'e4m3' or 'ds_mla'"),
    (lambda: quantize_kv(_E4M3), "kv_cache.dtype", "got torch.float8_e4m3fn, expected one of torch.bfloat16"),
    (lambda: quantize_kv(_BF16[..., :512]), "kv_cache.shape[-1]", "got 512, expected 576"),
    (lambda: quantize_kv(_BF16, "ds_mla", 1.0), "kv_scale", "got a float, expected None for layout 'ds_mla'"),
    (lambda: quantize_kv(_BF16, "e4m3", -1.0), "kv_scale", "got -1.0"),
    (lambda: dequantize_kv(_DS, "e4m3", 1.0), "kv_cache.dtype",
     "got torch.uint8, expected torch.float8_e4m3fn for layout 'e4m3'"),
    (lambda: dequantize_kv(_E4M3, "ds_mla"), "kv_cache.dtype", "got torch.float8_e4m3fn, expected torch.uint8"),
    (lambda: dequantize_kv(_E4M3, "e4m3"), "kv_scale", "got None"),
    (lambda: dequantize_kv(_DS, "ds_mla", dtype=torch.float8_e4m3fn), "dtype", "got torch.float8_e4m3fn"),
]


@pytest.mark.parametrize("call, name, rest", BAD_CALLS, ids=[f"{i}-{c[1]}" for i, c in enumerate(BAD_CALLS)])
def test_input_errors_name_the_argument(call, name, rest):
    with pytest.raises(InputError, match="^" + re.escape(f"{name}: {rest}")):
        call()


def test_value_checks_only_when_asked():
    """A tensor scale's value is read only with check_values; a float's is always checked."""
    assert kv_format_of(_E4M3, torch.zeros(1)).name == "e4m3"
    assert kv_format_of(_E4M3, torch.full((1,), 0.5), check_values=True).name == "e4m3"


# -- the reference on FP8 caches ---------------------------------------------------------------

def _case(seed: int, page_size: int = 16, mask: str = "causal", dtype: torch.dtype = torch.bfloat16):
    return make_case(batch=3, seqlen_q=4, heads=2, prefixes=[37, 5, 20], page_size=page_size, mask=mask,
                     seed=seed, device="cpu", dtype=dtype, empty=[False, False, True], spare_pages=2)


def _used_rows(case) -> torch.Tensor:
    """Bool [num_pages, page_size]: the cache rows some request reads (its first n keys)."""
    page_size = case.kv_cache.shape[1]
    used = torch.zeros(case.kv_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(case.cache_seqlens.tolist()):
        for j in range(n):
            used[case.block_table[b, j // page_size], j % page_size] = True
    return used


def _run(case, kv_cache, kv_scale=None, q=None, q_scale=None):
    return reference(case.q if q is None else q, kv_cache, case.block_table, case.cache_seqlens,
                     dtype=torch.float64, kv_scale=kv_scale, q_scale=q_scale, **case.kwargs())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_reference_on_fp8_equals_reference_on_dequantized(layout, mask):
    """Same bits as the reference on dequantize_kv's cache; within 2^-3 of the largest output
    of the reference on the bf16 cache it came from; no NaN from the NaN the case puts in unused
    pages and past lengths."""
    case = _case(seed=3, mask=mask)
    quantized, scale = quantize_kv(case.kv_cache, layout)
    out, lse = _run(case, quantized, scale)
    ref_out, ref_lse = _run(case, dequantize_kv(quantized, layout, scale))
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    bf16_out, _ = _run(case, case.kv_cache)
    assert (out - bf16_out).abs().max() < 2.0 ** -3 * bf16_out.abs().max()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_garbage_outside_the_used_rows_never_reaches_the_reference(layout):
    """Random bytes (NaN and inf patterns among them) in every row no request reads, in both
    layouts, and for ds_mla NaN and inf scale bytes in those rows: the result does not move."""
    case = _case(seed=5, page_size=8)
    quantized, scale = quantize_kv(case.kv_cache, layout)
    clean = _run(case, quantized, scale)
    unused = ~_used_rows(case)
    assert unused.any()
    raw = quantized.view(torch.uint8).clone()
    gen = torch.Generator().manual_seed(1)
    raw[unused] = torch.randint(0, 256, (int(unused.sum()), raw.shape[-1]), generator=gen, dtype=torch.uint8)
    raw[..., :8][unused] = 0xFF                                  # e4m3 NaN
    if layout == "ds_mla":
        nan_inf = torch.tensor([math.nan, math.inf, -math.inf, 0.0]).view(torch.uint8)
        raw[..., SCALES_AT:ROPE_AT][unused] = nan_inf
    garbage = raw.view(quantized.dtype)
    assert dequantize_kv(garbage, layout, scale)[unused].isnan().any()
    out, lse = _run(case, garbage, scale)
    assert torch.equal(out, clean[0]) and torch.equal(lse, clean[1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_agrees_with_the_plain_loop_on_fp8(layout):
    """The vectorized reference and reference_naive, both on an FP8 cache (the [.., 1, D] form),
    an fp8 q with a tensor q_scale, and a tree mask."""
    case = make_case(batch=2, seqlen_q=3, heads=1, prefixes=[6, 2], page_size=4, mask="tree", seed=11,
                     device="cpu", dtype=torch.float32)
    quantized, scale = quantize_kv(case.kv_cache[:, :, None], layout)
    q_scale = torch.full((1,), 2.0 ** -5)
    q = (case.q / q_scale).to(torch.float8_e4m3fn)
    out, lse = _run(case, quantized, scale, q=q, q_scale=q_scale)
    ref_out, ref_lse = reference_naive(q, quantized, case.block_table, case.cache_seqlens, softmax_scale=case.scale,
                                       tree_mask=case.tree_mask, head_dim_v=case.dl, kv_scale=scale, q_scale=q_scale)
    assert torch.allclose(out, ref_out, atol=1e-9, rtol=1e-9) and torch.allclose(lse, ref_lse, atol=1e-9)


@pytest.mark.parametrize("q_scale", [0.125, torch.full((), 0.125)])
def test_fp8_queries(q_scale):
    """float8_e4m3fn q with q_scale: the reference on q dequantized by the e4m3 rule, exactly."""
    case = _case(seed=7)
    q = (case.q.float() / 0.125).to(torch.float8_e4m3fn)
    out, lse = _run(case, case.kv_cache, q=q, q_scale=q_scale)
    ref_out, ref_lse = _run(case, case.kv_cache, q=dequantize_e4m3(q, 0.125))
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("call, name, rest", [
    (lambda c: _run(c, c.kv_cache, q=c.q.to(torch.float8_e4m3fn)), "q_scale", "got None, expected a float"),
    (lambda c: _run(c, c.kv_cache, q_scale=1.0), "q_scale", "got a float, expected None for a torch.bfloat16 q"),
    (lambda c: _run(c, c.kv_cache, kv_scale=1.0), "kv_scale", "got a float, expected None"),
    (lambda c: _run(c, c.kv_cache.to(torch.float8_e4m3fn)), "kv_scale", "got None"),
])
def test_reference_input_errors(call, name, rest):
    with pytest.raises(InputError, match="^" + re.escape(f"{name}: {rest}")):
        call(_case(seed=1))


def test_quantize_q_picks_or_takes_one_scale():
    """quantize_q: q's shape in float8_e4m3fn under amax / 448 over the finite values (NaN kept,
    not counted), or under the given scale, the e4m3 rule of quantize_kv's flat cache."""
    q = torch.randn(2, 3, 4, 576, dtype=torch.bfloat16)
    q[0, 0, 0, 0] = math.nan
    q8, scale = mlagen.quantize_q(q)
    finite = q.float().nan_to_num(0.0)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == q.shape and q8[0, 0, 0, 0].float().isnan()
    assert scale.shape == (1,) and scale.dtype == torch.float32
    assert torch.equal(scale, (finite.abs().amax() / 448).reshape(1))
    assert torch.equal(q8[1], (q[1].float() / scale).to(torch.float8_e4m3fn))
    given, same = mlagen.quantize_q(q, 0.5)
    assert same == 0.5 and torch.equal(given[1], (q[1].float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn))
    with pytest.raises(InputError, match=r"^q.dtype: got torch.float8_e4m3fn, expected one of torch.bfloat16"):
        mlagen.quantize_q(q8)
    with pytest.raises(InputError, match="^q_scale: got -1.0, expected a finite scale > 0"):
        mlagen.quantize_q(q, -1.0)


def test_exported():
    for name in ("quantize_kv", "quantize_q", "dequantize_kv", "kv_format_of", "KVFormat"):
        assert name in mlagen.__all__
