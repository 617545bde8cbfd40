"""A paged latent KV cache for MLA, in the layout `mlagen.verify_attention` reads.

One cached token is one latent row per layer: kv_lora_rank normalized latent dims (also the
value) then qk_rope_head_dim rope dims (576 = 512 + 64 for DeepSeek-V3 and Kimi K2). Every layer
keeps its rows at the same place, so one block table serves all of them:

- `pages`: [num_layers, num_pages, page_size, row width], one pool of pages; `layer(l)` is layer
  l's [num_pages, page_size, row width] cache;
- a block table per request slot ([max_requests, max_pages] int32), page ids in order, so row j
  of a request is row j % page_size of its page j // page_size;
- a length per slot: its rows 0..length-1 are valid.

Rows are stored as the row dtype (bf16, fp16, fp32 or fp64), or in an FP8 format of
`mlagen.runtime.kv_formats` (576-wide rows only): "e4m3" (one kv_scale per layer) or "ds_mla"
(DeepSeek's 656-byte rows with per-row scales), quantized by `mlagen.quantize_kv` as they are
written. Page bookkeeping (free list, block tables, lengths) lives on the host; the block table
is copied to the device when it changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..runtime.inputs import InputError
from ..runtime.kv_formats import LAYOUTS, quantize_kv

ROW_BYTE_VIEWS = (torch.float8_e4m3fn,)      # stored dtypes that copies move as bytes


@dataclass(frozen=True)
class RowIndex:
    """Where a batch's new rows go: request b's row s is row offset[b, s] of page page[b, s]
    (both [B, S] int64 on the cache's device); start[b] is its length before them."""

    page: torch.Tensor
    offset: torch.Tensor
    start: tuple[int, ...]


class PagedLatentCache:
    """Paged latent rows of every layer, for up to max_requests requests (slots).

    Args:
        num_layers: layers of the model (each has its own rows at the same places).
        num_pages: pages in the pool; page_size: rows per page (a power of two, as the op takes).
        max_requests: request slots; max_pages: block table width (pages one request may hold).
        latent_dim, rope_dim: the row is latent_dim + rope_dim wide (512 + 64 for DeepSeek-V3).
        dtype: the rows' dtype (the queries' dtype for `mlagen.verify_attention`).
        kv_format: None (rows in dtype), "e4m3" or "ds_mla" (FP8; needs 512 + 64).
        kv_scale: e4m3 only: the scale of every layer (a float) or one per layer (real value =
            stored value x scale). Pick it so that amax / kv_scale stays under 448.
        device: where the pages and the device block table live.
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, max_requests: int, max_pages: int,
                 latent_dim: int = 512, rope_dim: int = 64, dtype: torch.dtype = torch.bfloat16,
                 kv_format: str | None = None, kv_scale: float | Sequence[float] | None = None,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("max_requests", max_requests),
                            ("max_pages", max_pages), ("page_size", page_size)):
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{name}: got {value!r}, expected an int >= 1")
        if page_size & (page_size - 1):
            raise InputError(f"page_size: got {page_size}, expected a power of two")
        self.num_layers, self.page_size, self.max_pages = num_layers, page_size, max_pages
        self.latent_dim, self.rope_dim, self.dtype = latent_dim, rope_dim, dtype
        self.device = torch.device(device)
        self.kv_format = kv_format
        self.kv_scales: list[float] | None = None
        row = latent_dim + rope_dim
        if kv_format is None:
            if kv_scale is not None:
                raise InputError(f"kv_scale: got {kv_scale!r}, expected None without an FP8 kv_format")
            stored, width = dtype, row
        else:
            if kv_format not in LAYOUTS:
                raise InputError(f"kv_format: got {kv_format!r}, expected None, 'e4m3' or 'ds_mla'")
            if (latent_dim, rope_dim) != (512, 64):
                raise InputError(f"kv_format: got {kv_format!r} for {latent_dim} + {rope_dim}-wide rows, expected "
                                 "None: the FP8 formats hold 512 latent + 64 rope dims")
            fmt = LAYOUTS[kv_format]
            stored, width = fmt.dtype, fmt.row_dim
            if fmt.kv_scale:
                if kv_scale is None or isinstance(kv_scale, (int, float)):
                    scales = [1.0 if kv_scale is None else float(kv_scale)] * num_layers
                else:
                    scales = [float(s) for s in kv_scale]
                if len(scales) != num_layers or not all(s > 0 for s in scales):
                    raise InputError(f"kv_scale: got {kv_scale!r}, expected a float > 0 or {num_layers} of them")
                self.kv_scales = scales
            elif kv_scale is not None:
                raise InputError(f"kv_scale: got {kv_scale!r}, expected None for {kv_format!r} "
                                 "(its scales are per row)")
        self.pages = torch.zeros(num_layers, num_pages, page_size, width, dtype=stored, device=self.device)
        self._free = list(range(num_pages - 1, -1, -1))          # pop() hands out page 0 first
        self._table = torch.zeros(max_requests, max_pages, dtype=torch.int32)
        self._device_table: torch.Tensor | None = None
        self._owned: list[list[int]] = [[] for _ in range(max_requests)]
        self._lengths = [0] * max_requests
        self._live = [False] * max_requests

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self) -> int:
        """A free request slot, empty (length 0). Raises InputError when every slot is taken."""
        for slot, live in enumerate(self._live):
            if not live:
                self._live[slot] = True
                return slot
        raise InputError(f"max_requests: all {len(self._live)} request slots are in use; release one first")

    def release(self, slot: int) -> None:
        """Frees a slot and its pages."""
        self._check_slot(slot)
        self.truncate(slot, 0)
        self._live[slot] = False

    def length(self, slot: int) -> int:
        """Valid rows of a request."""
        self._check_slot(slot)
        return self._lengths[slot]

    def pages_of(self, slot: int) -> list[int]:
        """The page ids a request holds, in order."""
        self._check_slot(slot)
        return list(self._owned[slot])

    @property
    def free_pages(self) -> int:
        """Pages not held by any request."""
        return len(self._free)

    # -- the op's inputs --------------------------------------------------------------------------
    def layer(self, index: int) -> torch.Tensor:
        """Layer `index`'s cache, [num_pages, page_size, row width] in the stored dtype."""
        return self.pages[index]

    def kv_scale(self, index: int) -> float | None:
        """Layer `index`'s e4m3 kv_scale, None for other formats."""
        return None if self.kv_scales is None else self.kv_scales[index]

    def block_table(self, slots: Sequence[int]) -> torch.Tensor:
        """[len(slots), max_pages] int32 on the cache's device: the slots' block tables."""
        if self._device_table is None:
            self._device_table = self._table.to(self.device)
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        return self._device_table.index_select(0, index).contiguous()

    def seqlens(self, slots: Sequence[int]) -> torch.Tensor:
        """[len(slots)] int32 on the cache's device: the slots' lengths."""
        return torch.tensor([self._lengths[s] for s in slots], dtype=torch.int32, device=self.device)

    # -- writing ----------------------------------------------------------------------------------
    def append(self, slots: Sequence[int], count: int) -> RowIndex:
        """Extends each slot by `count` rows (allocating pages) and says where they go; their
        contents are written per layer by `write`. Raises InputError when a request would need
        more than max_pages pages or the pool runs out (nothing changes then)."""
        for s in slots:
            self._check_slot(s)
        if len(set(slots)) != len(slots):
            raise InputError(f"slots: got {list(slots)}, expected distinct slots")
        need = [-(-(self._lengths[s] + count) // self.page_size) - len(self._owned[s]) for s in slots]
        for s, n in zip(slots, need, strict=True):
            if len(self._owned[s]) + n > self.max_pages:
                raise InputError(f"slots: request {s} would hold {self._lengths[s] + count} rows, expected at most "
                                 f"{self.max_pages * self.page_size} (max_pages={self.max_pages} x "
                                 f"page_size={self.page_size})")
        if sum(max(n, 0) for n in need) > len(self._free):
            raise InputError(f"num_pages: the pool has {len(self._free)} free pages, the batch needs "
                             f"{sum(max(n, 0) for n in need)} more; release requests or make a larger cache")
        for s, n in zip(slots, need, strict=True):
            for _ in range(n):
                page = self._free.pop()
                self._table[s, len(self._owned[s])] = page
                self._owned[s].append(page)
                self._device_table = None
        start = tuple(self._lengths[s] for s in slots)
        rows = torch.tensor(start)[:, None] + torch.arange(count)[None, :]                       # [B, S]
        table = self._table[torch.tensor(list(slots), dtype=torch.long)].long()
        page = table.gather(1, rows // self.page_size)
        for s in slots:
            self._lengths[s] += count
        return RowIndex(page=page.to(self.device), offset=(rows % self.page_size).to(self.device), start=start)

    def write(self, layer: int, index: RowIndex, rows: torch.Tensor) -> None:
        """Writes rows [B, S, latent + rope] (any float dtype) of layer `layer` where `index` says,
        converted to the stored dtype (quantized for an FP8 format)."""
        width = self.latent_dim + self.rope_dim
        if rows.dim() != 3 or tuple(rows.shape[:2]) != tuple(index.page.shape) or rows.shape[-1] != width:
            raise InputError(f"rows.shape: got {tuple(rows.shape)}, expected [{index.page.shape[0]}, "
                             f"{index.page.shape[1]}, {width}]")
        flat = rows.reshape(-1, 1, width)                   # quantize_kv's [pages, page_size, D] with one row a page
        if self.kv_format is None:
            stored = flat.to(self.dtype)
        else:
            source = flat if flat.dtype in (torch.bfloat16, torch.float16, torch.float32) else flat.float()
            stored, _ = quantize_kv(source, self.kv_format, self.kv_scale(layer))
        target = self._bytes(self.pages[layer])
        target[index.page.reshape(-1), index.offset.reshape(-1)] = self._bytes(stored).reshape(-1, target.shape[-1])

    def keep(self, slot: int, start: int, kept: Sequence[int]) -> None:
        """Keeps rows start + kept[j] (kept strictly ascending) at rows start + j, in every
        layer, and cuts the request to start + len(kept) rows: a verified draft's accepted nodes
        become its committed rows, the rejected ones go."""
        self._check_slot(slot)
        kept = [int(k) for k in kept]
        end = start + len(kept)
        ascending = all(a < b for a, b in zip(kept, kept[1:], strict=False))
        if not ascending or (kept and (kept[0] < 0 or start + kept[-1] >= self._lengths[slot])) or start < 0:
            raise InputError(f"kept: got {kept} past row {start}, expected ascending draft rows below the request's "
                             f"length {self._lengths[slot]}")
        moved = [(start + k, start + j) for j, k in enumerate(kept) if k != j]
        if moved:
            src, dst = (torch.tensor(v) for v in zip(*moved, strict=True))
            table = torch.tensor(self._owned[slot])
            pages = self._bytes(self.pages)
            src_page, src_off = table[src // self.page_size].to(self.device), (src % self.page_size).to(self.device)
            dst_page, dst_off = table[dst // self.page_size].to(self.device), (dst % self.page_size).to(self.device)
            pages[:, dst_page, dst_off] = pages[:, src_page, src_off]       # gathered first: moves never overlap
        self.truncate(slot, end)

    def truncate(self, slot: int, length: int) -> None:
        """Cuts a request to its first `length` rows and returns the pages it no longer needs."""
        self._check_slot(slot)
        if not 0 <= length <= self._lengths[slot]:
            raise InputError(f"length: got {length}, expected 0..{self._lengths[slot]} (request {slot}'s length)")
        self._lengths[slot] = length
        pages = -(-length // self.page_size)
        while len(self._owned[slot]) > pages:
            self._free.append(self._owned[slot].pop())
            self._table[slot, len(self._owned[slot])] = 0
            self._device_table = None

    def rows(self, layer: int, slot: int) -> torch.Tensor:
        """A request's valid rows of one layer, [length, row width] in the stored dtype (for checks)."""
        self._check_slot(slot)
        n = self._lengths[slot]
        table = torch.tensor(self._owned[slot], dtype=torch.long, device=self.device)
        pages = self._bytes(self.pages[layer]).index_select(0, table)
        return pages.view(self.pages.dtype).reshape(-1, self.pages.shape[-1])[:n]

    # -- helpers ----------------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not (isinstance(slot, int) and 0 <= slot < len(self._live) and self._live[slot]):
            raise InputError(f"slot: got {slot!r}, expected a slot from add_request() that is not released")

    @staticmethod
    def _bytes(x: torch.Tensor) -> torch.Tensor:
        """x, or an e4m3 tensor viewed as uint8: float8 dtypes lack some indexing kernels."""
        return x.view(torch.uint8) if x.dtype in ROW_BYTE_VIEWS else x
