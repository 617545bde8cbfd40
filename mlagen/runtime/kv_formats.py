"""The KV cache formats: what a cache tensor holds, and conversions to and from FP8.

A cached token is one 576-wide MLA row: 512 latent dims (also the value) and 64 rope dims.
Four formats hold it, each told apart by the cache tensor's dtype alone (docs/design.md, "FP8
KV caches"):

| format | dtype | cache shape | one row |
|---|---|---|---|
| bf16, fp16 | bfloat16, float16 | [num_pages, page_size, (1,) D] | D values (576 for DeepSeek's MLA) |
| e4m3 | float8_e4m3fn | [num_pages, page_size, (1,) 576] | 576 e4m3 values; real = stored x kv_scale |
| ds_mla | uint8 | [num_pages, page_size, (1,) 656] | 656 bytes, below |

**e4m3** (vLLM's, SGLang's and TensorRT-LLM's FP8 MLA cache): every dim in e4m3, with one
per-tensor `kv_scale`, a Python float or a one-element fp32 tensor on the cache's device (a
tensor can change between calls without a recompile and inside CUDA graphs).

**ds_mla** (DeepSeek's 656-byte rows: FlashMLA's FP8 cache, vLLM's `fp8_ds_mla`), per row:
bytes 0-511 the 512 latent dims in e4m3; bytes 512-527 four fp32 scales, little-endian, scale g
for latent dims 128g..128g+127 (real latent value = e4m3 value x its group's scale); bytes
528-655 the 64 rope dims in bf16, unscaled.

Dequantizing is `stored x scale` in fp32, nothing else. Quantizing picks the scales:

- e4m3, without a given kv_scale: amax / 448 over the cache's finite values (at least the
  smallest normal fp32, so it is positive).
- ds_mla, per row and group: amax / 448, raised to at least 1e-4, then rounded up to a power of
  two, as FlashMLA's own test quantizer does: the caches are byte for byte the same, and
  dividing by a power of two is exact, so the only error is e4m3's rounding.

Values beyond +-448 x scale saturate to +-448; NaN stays NaN. Everything is plain torch ops on
the cache's device, with no host read, except `kv_format_of(..., check_values=True)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..dsl.kv_layout import (
    DS_MLA_ROW_BYTES,
    E4M3_BYTES,
    GROUP_DIM,
    GROUPS,
    LATENT_DIM,
    ROPE_AT,
    ROPE_DIM,
    ROPE_VALUE_BYTES,
    ROW_DIM,
    SCALE_BYTES,
    SCALES_AT,
)
from .inputs import InputError, fail

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max                # 448.0, the largest finite e4m3 value
SCALE_DTYPE = torch.float32                     # ds_mla's group scales, and a kv_scale tensor's dtype
ROPE_DTYPE = torch.bfloat16                     # ds_mla's rope dims
assert SCALE_DTYPE.itemsize == SCALE_BYTES and ROPE_DTYPE.itemsize == ROPE_VALUE_BYTES and E4M3.itemsize == E4M3_BYTES
DS_MLA_MIN_SCALE = 1e-4                         # amax / 448 is raised to this before rounding up
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what quantize_kv converts


@dataclass(frozen=True)
class KVFormat:
    """One KV cache format. A cache tensor is in it when its dtype is `dtype` (each format has
    its own); its last dim must then be `row_dim` (any width where None: the 16-bit caches take
    the op's Dl + Dr, 576 for DeepSeek's MLA).

    name: "bf16", "fp16", "e4m3" or "ds_mla" (also the `layout` of quantize_kv and dequantize_kv).
    kv_scale: whether a per-tensor kv_scale goes with the cache (e4m3 only; ds_mla's scales
    live in its rows).
    """

    name: str
    dtype: torch.dtype
    row_dim: int | None
    kv_scale: bool
    description: str

    @property
    def row_bytes(self) -> int:
        """Bytes of one cached token of DeepSeek's 576-wide MLA row: 1152, 1152, 576, 656."""
        return (self.row_dim or ROW_DIM) * self.dtype.itemsize


BF16 = KVFormat("bf16", torch.bfloat16, None, False, "bf16 rows")
FP16 = KVFormat("fp16", torch.float16, None, False, "fp16 rows")
E4M3_FLAT = KVFormat("e4m3", E4M3, ROW_DIM, True,
                     f"{LATENT_DIM} latent + {ROPE_DIM} rope dims in e4m3, one per-tensor kv_scale")
DS_MLA = KVFormat("ds_mla", torch.uint8, DS_MLA_ROW_BYTES, False,
                  f"DeepSeek's {DS_MLA_ROW_BYTES}-byte rows: {LATENT_DIM} e4m3 latent dims, {GROUPS} fp32 "
                  f"scales (one per {GROUP_DIM} latent dims), {ROPE_DIM} bf16 rope dims")
FORMATS = (BF16, FP16, E4M3_FLAT, DS_MLA)
LAYOUTS = {f.name: f for f in (E4M3_FLAT, DS_MLA)}      # the FP8 formats, by quantize_kv's layout
QUANTIZED_DTYPES = frozenset(f.dtype for f in LAYOUTS.values())


def _rows(name: str, x: object, dtypes: str) -> torch.Tensor:
    """x checked to be a tensor of [num_pages, page_size, D] or [num_pages, page_size, 1, D]."""
    if not isinstance(x, torch.Tensor):
        fail(name, type(x).__name__, f"a torch.Tensor of {dtypes}")
    if not (x.dim() == 3 or (x.dim() == 4 and x.size(2) == 1)):
        fail(f"{name}.shape", tuple(x.shape), "[num_pages, page_size, D] or [num_pages, page_size, 1, D]")
    return x


def _layout(layout: object) -> KVFormat:
    if layout not in LAYOUTS:
        fail("layout", repr(layout), " or ".join(repr(n) for n in LAYOUTS))
    return LAYOUTS[layout]


def check_scale(name: str, scale: object, device: torch.device, *, check_values: bool = False) -> None:
    """A per-tensor scale: a finite float > 0, or a one-element fp32 tensor on `device`. A
    tensor's value is read (a device read, refused during CUDA graph capture) only with
    check_values. Raises InputError naming `name`."""
    expected = f"a float or a one-element {SCALE_DTYPE} tensor on {device}"
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        value = float(scale)
    elif isinstance(scale, torch.Tensor):
        if scale.dtype != SCALE_DTYPE or scale.numel() != 1:
            fail(name, f"a {scale.dtype} tensor of shape {tuple(scale.shape)}", expected)
        if scale.device != device:
            fail(name, f"a tensor on {scale.device}", expected)
        if not check_values:
            return
        if scale.is_cuda and torch.cuda.is_current_stream_capturing():
            raise InputError(f"check_values: cannot read {name} back while a CUDA graph is being captured; "
                             "check outside the capture or pass check_values=False")
        value = float(scale.reshape(()))
    else:
        fail(name, "None" if scale is None else type(scale).__name__, expected)
    if not (math.isfinite(value) and value > 0):
        fail(name, value, "a finite scale > 0")


def kv_format_of(kv_cache: torch.Tensor, kv_scale: float | torch.Tensor | None = None, *,
                 check_values: bool = False) -> KVFormat:
    """The format of a KV cache tensor, checked with its kv_scale.

    kv_cache: [num_pages, page_size, D] or [num_pages, page_size, 1, D] of bf16 or fp16 (any D),
    float8_e4m3fn (D = 576) or uint8 (D = 656, DeepSeek's ds_mla rows). kv_scale: for e4m3 a
    float or a one-element fp32 tensor on the cache's device, else None. check_values: also
    read a tensor kv_scale back (a device read) to check that it is finite and > 0; a float is
    always checked. Returns the KVFormat; raises InputError naming the argument at fault.
    """
    names = ", ".join(f"{f.dtype} ({f.name})" for f in FORMATS)
    kv_cache = _rows("kv_cache", kv_cache, names)
    fmt = next((f for f in FORMATS if f.dtype == kv_cache.dtype), None)
    if fmt is None:
        fail("kv_cache.dtype", kv_cache.dtype, f"one of {names}")
    if fmt.row_dim is not None and kv_cache.size(-1) != fmt.row_dim:
        fail("kv_cache.shape[-1]", kv_cache.size(-1), f"{fmt.row_dim} for a {fmt.dtype} cache ({fmt.description})")
    if fmt.kv_scale:
        check_scale("kv_scale", kv_scale, kv_cache.device, check_values=check_values)
    elif kv_scale is not None:
        fail("kv_scale", f"a {type(kv_scale).__name__}",
              f"None for a {fmt.dtype} cache ({fmt.description}): only e4m3 caches take one")
    return fmt


def quantize_kv(kv_cache: torch.Tensor, layout: str = "e4m3",
                kv_scale: float | torch.Tensor | None = None) -> tuple[torch.Tensor, float | torch.Tensor | None]:
    """A bf16, fp16 or fp32 KV cache in an FP8 format.

    kv_cache: [num_pages, page_size, 576] or [num_pages, page_size, 1, 576]. layout: "e4m3"
    (every dim in float8_e4m3fn, one per-tensor scale) or "ds_mla" (DeepSeek's 656-byte uint8
    rows, a scale per 128 latent dims of each row; the rope dims rounded to bf16). kv_scale
    (e4m3 only): the scale to use, a float or a one-element fp32 tensor on the cache's device;
    None picks amax / 448 over the cache's finite values, so NaN in unused pages does not reach it.

    Returns (quantized, scale): quantized keeps kv_cache's shape but the last dim (576 e4m3
    values or 656 bytes); scale is the e4m3 scale (kv_scale as given, or the picked one as a
    one-element fp32 tensor on the cache's device), None for ds_mla. Values beyond +-448 x scale
    saturate. No host read.
    """
    kv_cache = _rows("kv_cache", kv_cache, "bf16, fp16 or fp32")
    if kv_cache.dtype not in SOURCE_DTYPES:
        fail("kv_cache.dtype", kv_cache.dtype, f"one of {', '.join(str(d) for d in SOURCE_DTYPES)}")
    if kv_cache.size(-1) != ROW_DIM:
        fail("kv_cache.shape[-1]", kv_cache.size(-1), f"{ROW_DIM} ({LATENT_DIM} latent + {ROPE_DIM} rope dims)")
    fmt = _layout(layout)
    x = kv_cache.float()
    if fmt is E4M3_FLAT:
        return _per_tensor_e4m3("kv_scale", x, kv_scale)
    if kv_scale is not None:
        fail("kv_scale", f"a {type(kv_scale).__name__}",
              f"None for layout 'ds_mla', which picks a scale per {GROUP_DIM} latent dims of each row")
    latent = x[..., :LATENT_DIM].unflatten(-1, (GROUPS, GROUP_DIM))        # [..., 4, 128]
    scales = _power_of_two_at_least((_finite_amax(latent, dim=-1) / E4M3_MAX).clamp_min(DS_MLA_MIN_SCALE))
    packed = (_to_e4m3(latent / scales[..., None]).flatten(-2).view(torch.uint8),
              scales.contiguous().view(torch.uint8),
              x[..., LATENT_DIM:].to(ROPE_DTYPE).contiguous().view(torch.uint8))
    return torch.cat(packed, dim=-1), None


def quantize_q(q: torch.Tensor,
               q_scale: float | torch.Tensor | None = None) -> tuple[torch.Tensor, float | torch.Tensor]:
    """bf16, fp16 or fp32 queries (any shape, e.g. [B, S, H, 576]) as float8_e4m3fn with one
    per-tensor q_scale (real value = stored value x q_scale), as `verify_attention(q_scale=)`
    takes them.

    q_scale: the scale to use, a float or a one-element fp32 tensor on q's device; None picks
    amax / 448 over q's finite values. Returns (e4m3 queries of q's shape, the scale: as given,
    or the picked one as a one-element fp32 tensor on q's device). Values beyond +-448 x q_scale
    saturate. No host read.
    """
    if not isinstance(q, torch.Tensor):
        fail("q", type(q).__name__, "a torch.Tensor of bf16, fp16 or fp32")
    if q.dtype not in SOURCE_DTYPES:
        fail("q.dtype", q.dtype, f"one of {', '.join(str(d) for d in SOURCE_DTYPES)}")
    return _per_tensor_e4m3("q_scale", q.float(), q_scale)


def _per_tensor_e4m3(name: str, x: torch.Tensor,
                     scale: float | torch.Tensor | None) -> tuple[torch.Tensor, float | torch.Tensor]:
    """fp32 `x` as e4m3 under one scale: `scale` checked (named `name`), or amax / 448 over x's
    finite values (at least the smallest normal fp32) as a one-element fp32 tensor."""
    if scale is None:
        scale = (_finite_amax(x, dim=None) / E4M3_MAX).clamp_min(torch.finfo(SCALE_DTYPE).smallest_normal).reshape(1)
    else:
        check_scale(name, scale, x.device)
    return _to_e4m3(x / _broadcastable(scale)), scale


def dequantize_kv(kv_cache: torch.Tensor, layout: str, kv_scale: float | torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An FP8 KV cache's real values: stored value x scale, computed in fp32, then cast to dtype.

    kv_cache: float8_e4m3fn [num_pages, page_size, (1,) 576] with layout "e4m3" and its
    kv_scale (a float or a one-element fp32 tensor on the cache's device), or uint8
    [num_pages, page_size, (1,) 656] with layout "ds_mla" (no kv_scale: each row's latent dims
    times their group's fp32 scale, the bf16 rope dims as they are). dtype: a floating dtype of
    16 bits or more. Returns [num_pages, page_size, 576] in dtype. No host read; bytes that are
    not a number (unused rows) give NaN or inf in their own rows only.
    """
    fmt = _layout(layout)
    kv_cache = _rows("kv_cache", kv_cache, f"{fmt.dtype} for layout {layout!r}")
    if kv_cache.dtype != fmt.dtype:
        fail("kv_cache.dtype", kv_cache.dtype, f"{fmt.dtype} for layout {layout!r}")
    kv_format_of(kv_cache, kv_scale)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2):
        fail("dtype", dtype, "a floating dtype of 16 bits or more (torch.float32, torch.float64, ...)")
    rows = kv_cache.reshape(kv_cache.size(0), kv_cache.size(1), kv_cache.size(-1))
    if fmt is E4M3_FLAT:
        return dequantize_e4m3(rows, kv_scale).to(dtype)  # type: ignore[arg-type]  # kv_format_of refused None
    latent = rows[..., :SCALES_AT].view(E4M3).float().unflatten(-1, (GROUPS, GROUP_DIM))
    scales = rows[..., SCALES_AT:ROPE_AT].contiguous().view(SCALE_DTYPE)
    rope = rows[..., ROPE_AT:].contiguous().view(ROPE_DTYPE).float()
    return torch.cat(((latent * scales[..., None]).flatten(-2), rope), dim=-1).to(dtype)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor viewed as its bytes (uint8, same shape), for the gathers and copies that
    float8 dtypes lack; any other tensor as it is."""
    return x.view(torch.uint8) if x.dtype == E4M3 else x


def dequantize_e4m3(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values x scale (a float or a one-element fp32 tensor), in fp32, x's shape:
    the flat e4m3 cache's rule, also for FP8 queries. Unchecked: see `check_scale`."""
    return x.float() * _broadcastable(scale)


def _broadcastable(scale: float | torch.Tensor) -> float | torch.Tensor:
    """A one-element tensor as a 0-dim one, so that it broadcasts without adding dims."""
    return scale.reshape(()) if isinstance(scale, torch.Tensor) else scale


def _finite_amax(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The largest |value| over dim (all dims if None) among the finite ones (0 if none)."""
    magnitude = torch.where(torch.isfinite(x), x.abs(), 0.0)
    return magnitude.amax() if dim is None else magnitude.amax(dim=dim)


def _power_of_two_at_least(v: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= v, for normal positive fp32 v, exactly: frexp gives v = m x 2^e
    with m in [0.5, 1), so v / m is 2^e without rounding, and v itself when m = 0.5."""
    m, _ = torch.frexp(v)
    return torch.where(m == 0.5, v, v / m)


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 to float8_e4m3fn, rounding to nearest, saturating at +-448, NaN kept."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
