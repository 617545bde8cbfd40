"""`mlagen bench --sparse`: sparse verify rows (DeepSeek Sparse Attention) timed against the floor
and FlashMLA's sparse FP8 decode.

Each query token attends to its own topk rows of DeepSeek's 656-byte FP8 cache. Per row: the
dispatcher's pick and any named variants (µs under CUDA graph replay, the gathers rotated past
the L2; TFLOP/s; the time over the floor: the products at the bf16 matmul rate or the gathered
rows at the copy bandwidth, whichever is longer), then FlashMLA's sparse kernel on the same
inputs where a build loads (`live_peer`), with mlagen / FlashMLA and the largest output
difference between the two.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..dsl.kv_layout import DS_MLA_ROW_BYTES, LATENT_DIM, ROW_DIM
from ..dsl.spec import Variant
from .live_peer import load_flashmla, sparse_call
from .stamp import stamp
from .tables import markdown_table, text_table
from .timing import TimingConfig, copy_bandwidth, failure_text, l2_bytes, matmul_rate, measure, rotation_count

PAGE_SIZE = 64
CACHE_KEYS = 65536              # cached keys a request's tokens pick from, by default
DISPATCH = "dispatch"
FLASHMLA = "FlashMLA"           # the key of FlashMLA's error in a row's errors
FILES = ("sparse.json", "sparse.md")


@dataclass(frozen=True)
class SparseRow:
    """One sparse verify shape: B requests of S tokens over H heads, topk rows a token."""

    heads: int
    batch: int
    seqlen_q: int
    topk: int

    @property
    def flops(self) -> int:
        """The two products' flop: scores over 576 dims, P V over 512."""
        return 2 * self.batch * self.seqlen_q * self.heads * self.topk * (ROW_DIM + LATENT_DIM)

    @property
    def gathered_bytes(self) -> int:
        """The cache bytes the tokens list, counting a row once a token."""
        return self.batch * self.seqlen_q * self.topk * DS_MLA_ROW_BYTES

    def __str__(self) -> str:
        return f"H={self.heads} B={self.batch} S={self.seqlen_q} topk={self.topk}"


def sparse_grid(heads: Sequence[int] = (64, 128), seqlen_q: Sequence[int] = (1, 2, 4),
                batch: Sequence[int] = (1, 8, 32, 128), topk: int = 2048) -> list[SparseRow]:
    """The rows, heads outermost: by default DeepSeek-V3.2's (H 64 and 128, MTP drafts of 1-4
    tokens, topk 2048) over batches of 1 to 128 requests."""
    return [SparseRow(h, b, s, topk) for h in heads for s in seqlen_q for b in batch]


@dataclass
class SparseInputs:
    q: torch.Tensor              # [B, S, H, 576] bf16
    kv_cache: torch.Tensor       # [B * pages, PAGE_SIZE, 656] uint8 (ds_mla rows)
    indices: torch.Tensor        # [B, S, topk] int32, rows of request b's pages
    out: torch.Tensor            # [B, S, H, 512] bf16


def sparse_inputs(row: SparseRow, cache_keys: int, sets: int, device: str, seed: int = 0) -> list[SparseInputs]:
    """`sets` input sets sharing one cache of cache_keys keys a request (random bf16 rows
    quantized to ds_mla): each its own q and indices (topk distinct rows of the request's region
    per token, in random order) and out."""
    from ..runtime.kv_formats import quantize_kv

    gen = torch.Generator(device=device).manual_seed(seed)
    pages = -(-cache_keys // PAGE_SIZE)
    rows = torch.randn(row.batch * pages, PAGE_SIZE, ROW_DIM, generator=gen, device=device, dtype=torch.bfloat16)
    cache, _ = quantize_kv(rows, "ds_mla")
    base = (torch.arange(row.batch, device=device) * pages * PAGE_SIZE)[:, None, None]
    result = []
    for _ in range(sets):
        picks = torch.rand(row.batch, row.seqlen_q, pages * PAGE_SIZE, generator=gen, device=device)
        indices = (picks.topk(row.topk, dim=-1).indices + base).to(torch.int32)
        q = torch.randn(row.batch, row.seqlen_q, row.heads, ROW_DIM, generator=gen, device=device,
                        dtype=torch.bfloat16)
        out = torch.empty(row.batch, row.seqlen_q, row.heads, LATENT_DIM, dtype=torch.bfloat16, device=device)
        result.append(SparseInputs(q, cache, indices, out))
    return result


@dataclass(frozen=True)
class SparseConfig:
    cache_keys: int = CACHE_KEYS
    timing: TimingConfig = TimingConfig()
    extra: tuple[Variant, ...] = ()     # named variants timed beside the dispatcher's pick
    flashmla: Path | None = None        # the FlashMLA checkout (`live_peer.checkout_path`)


@dataclass
class SparseRowResult:
    heads: int
    batch: int
    seqlen_q: int
    topk: int
    floor_us: float
    us: dict[str, float] = field(default_factory=dict)        # "dispatch" and the named variants
    errors: dict[str, str] = field(default_factory=dict)      # a cell's (or FLASHMLA's) error instead of its time
    flashmla_us: float | None = None
    flashmla_diff: float | None = None                        # max |FlashMLA - dispatch| over the outputs

    @property
    def row(self) -> SparseRow:
        return SparseRow(self.heads, self.batch, self.seqlen_q, self.topk)

    def tflops(self, us: float) -> float:
        return self.row.flops / us / 1e6

    @property
    def vs_flashmla(self) -> float | None:
        """The dispatched time over FlashMLA's."""
        d = self.us.get(DISPATCH)
        return d / self.flashmla_us if d and self.flashmla_us else None


@dataclass
class SparseResult:
    meta: dict
    cells: list[str]                                          # "dispatch", then the named variants
    rows: list[SparseRowResult] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"


def run_sparse(rows: Sequence[SparseRow], config: SparseConfig, progress=None) -> SparseResult:
    """Time every row on the current CUDA device. `progress`: an optional rich Progress."""
    from ..runtime.op import verify_attention

    device = torch.cuda.current_device()
    floors = (matmul_rate(device), copy_bandwidth(device))
    live = load_flashmla(config.flashmla, device)
    meta = stamp(device) | {"matmul_tflops": floors[0] / 1e12, "copy_tbps": floors[1] / 1e12,
                            "cache_keys": config.cache_keys, "page_size": PAGE_SIZE, "kv_format": "ds_mla",
                            "flashmla": (f"timed live on the same inputs (FlashMLA built at {live.source})"
                                         if live.module else f"not run: {live.reason}")}
    result = SparseResult(meta=meta, cells=[DISPATCH, *(v.name for v in config.extra)])
    task = progress.add_task("timing sparse rows", total=len(rows)) if progress else None
    scale = ROW_DIM ** -0.5
    for row in rows:
        if progress:
            progress.update(task, description=f"timing {row}")
        floor = max(row.flops / floors[0], row.gathered_bytes / floors[1]) * 1e6
        cell = SparseRowResult(row.heads, row.batch, row.seqlen_q, row.topk, floor_us=floor)
        try:
            sets = sparse_inputs(row, config.cache_keys, rotation_count(row.gathered_bytes, l2_bytes(device)), "cuda")
        except Exception as e:   # e.g. out of memory: every cell of the row fails, the run goes on
            cell.errors = {name: "inputs: " + failure_text(e) for name in result.cells}
            result.rows.append(cell)
            torch.cuda.empty_cache()
            continue
        dispatch_out = None
        for name, variant in zip(result.cells, (None, *config.extra), strict=True):
            def call(s: SparseInputs, v: Variant | None = variant) -> torch.Tensor:
                return verify_attention(s.q, s.kv_cache, indices=s.indices, causal=False, softmax_scale=scale,
                                        out=s.out, variant=v)
            try:
                cell.us[name] = measure(call, sets, config.timing).us
                if name == DISPATCH:
                    dispatch_out = call(sets[0]).float()
            except Exception as e:    # a variant that does not fit the row: its cell says why, the run goes on
                cell.errors[name] = failure_text(e)
        if live.module is not None:
            flash = sparse_call(live.module, scale)
            try:
                cell.flashmla_us = measure(flash, sets, config.timing).us
            except Exception as e:    # FlashMLA checks its own limits (64 or 128 heads): the row says so
                cell.errors[FLASHMLA] = failure_text(e)
            else:
                if dispatch_out is not None:
                    cell.flashmla_diff = (flash(sets[0]).float() - dispatch_out).abs().max().item()
        result.rows.append(cell)
        del sets, dispatch_out
        torch.cuda.empty_cache()
        if progress:
            progress.advance(task)
    return result


def _time(r: SparseRowResult, name: str) -> str:
    if name in r.errors:
        return "failed"
    us = r.us.get(name)
    return f"{us:.1f} ({r.tflops(us):.0f} TF, {us / r.floor_us:.2f}×)" if us else "—"


def table_rows(result: SparseResult) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows: µs (TFLOP/s, × floor) per cell, then FlashMLA's."""
    header = ["H", "B", "S", "topk", "floor µs", *[f"{c} µs (TFLOP/s, × floor)" for c in result.cells],
              "FlashMLA µs (TFLOP/s)", "dispatch / FlashMLA", "max |diff|"]
    rows = []
    for r in result.rows:
        flash = (f"{r.flashmla_us:.1f} ({r.tflops(r.flashmla_us):.0f} TF)" if r.flashmla_us
                 else "failed" if FLASHMLA in r.errors else "—")
        ratio = f"{r.vs_flashmla:.2f}×" if r.vs_flashmla else "—"
        diff = f"{r.flashmla_diff:.1e}" if r.flashmla_diff is not None else "—"
        rows.append([str(r.heads), str(r.batch), str(r.seqlen_q), str(r.topk), f"{r.floor_us:.1f}",
                     *[_time(r, c) for c in result.cells], flash, ratio, diff])
    return header, rows


def rich_table(result: SparseResult):
    """The table for a terminal (rich)."""
    header, rows = table_rows(result)
    return text_table(f"mlagen bench --sparse, {result.meta.get('gpu', '?')}", header, rows,
                      caption=f"FlashMLA: {result.meta.get('flashmla', '?')}")


def markdown(result: SparseResult) -> str:
    """The run as markdown: what ran where, the FlashMLA ratio's spread, the table, the errors."""
    m = result.meta
    lines = ["# mlagen bench --sparse", "",
             f"- {m.get('gpu', '?')} ({m.get('arch', '?')}), driver {m.get('driver', '?')}, "
             f"torch {m.get('torch', '?')}, {m.get('date_utc', '?')}",
             f"- ds_mla cache (656-byte rows), {m.get('page_size')}-key pages, {m.get('cache_keys')} keys a request; "
             f"ceilings measured now: bf16 matmul {m.get('matmul_tflops', 0):.0f} TFLOP/s, copy "
             f"{m.get('copy_tbps', 0):.2f} TB/s",
             f"- FlashMLA: {m.get('flashmla', '?')}"]
    ratios = sorted((r.vs_flashmla, str(r.row)) for r in result.rows if r.vs_flashmla)
    if ratios:
        lines.append(f"- dispatch / FlashMLA over {len(ratios)} rows: best {ratios[0][0]:.2f}×, median "
                     f"{ratios[len(ratios) // 2][0]:.2f}×, worst {ratios[-1][0]:.2f}× ({ratios[-1][1]})")
    header, rows = table_rows(result)
    lines += ["", *markdown_table(header, rows)]
    errors = [f"- {r.row} {name}: {err.splitlines()[0] if err else ''}" for r in result.rows
              for name, err in r.errors.items()]
    if errors:
        lines += ["", "## Errors", "", *errors]
    return "\n".join(lines) + "\n"


def write_all(result: SparseResult, out_dir: Path) -> list[Path]:
    """sparse.json and sparse.md in out_dir (created)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in FILES]
    paths[0].write_text(result.to_json())
    paths[1].write_text(markdown(result))
    return paths
