"""Time sparse verify rows (DeepSeek Sparse Attention): each query token attends to its own topk
rows of DeepSeek's 656-byte FP8 cache, through the dispatcher's pick and, where the `flash_mla`
package of a FlashMLA build loads (benchmarks/build_flashmla.py; `mlagen.tools.live_peer`), FlashMLA's
sparse decode kernel on the same inputs.

    python3 benchmarks/sparse_rows.py [--heads H ...] [--seqlen-q S ...] [--batch B ...]
                                      [--topk K] [--cache-keys N] [--variant NAME ...] [--flashmla DIR]

Defaults: H 64 128, S 1 2 4, B 1 8 32 128, topk 2048, 65536 cached keys a request. Request b's
tokens list random rows (distinct within a token) of its own 65536-key region of the cache, on
64-key pages. Prints per row, for the dispatcher's pick and each named variant: µs per call under
CUDA graph replay (index sets rotated past the L2), TFLOP/s (2 B S H topk (576 + 512) flop), and
the time over the floor (the products at the bf16 matmul rate, or the gathered rows at the copy
bandwidth, whichever is longer); then FlashMLA's µs, mlagen / FlashMLA and the largest output
difference between the two, or why FlashMLA did not run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_cli import parser, require_gpu, variant_name

from mlagen.dsl.kv_layout import DS_MLA_ROW_BYTES, LATENT_DIM, ROW_DIM
from mlagen.dsl.spec import Variant, parse_variant
from mlagen.tools.live_peer import LivePeer, load_flashmla, sparse_call

PAGE_SIZE = 64


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


@dataclass
class SparseInputs:
    q: torch.Tensor              # [B, S, H, 576] bf16
    kv_cache: torch.Tensor       # [B * pages, 64, 656] uint8 (ds_mla rows)
    indices: torch.Tensor        # [B, S, topk] int32, rows of request b's pages
    out: torch.Tensor            # [B, S, H, 512] bf16


def sparse_inputs(row: SparseRow, cache_keys: int, sets: int, device: str, seed: int = 0) -> list[SparseInputs]:
    """`sets` input sets sharing one cache of cache_keys keys a request (random bf16 rows
    quantized to ds_mla): each its own q and indices (topk distinct rows of the request's region
    per token, in random order) and out."""
    from mlagen import quantize_kv

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


def run_row(row: SparseRow, cache_keys: int, variants: list[Variant | None], floors: tuple[float, float],
            live: LivePeer) -> None:
    from mlagen import verify_attention
    from mlagen.tools.timing import l2_bytes, measure, rotation_count

    count = rotation_count(row.gathered_bytes, l2_bytes(0))
    sets = sparse_inputs(row, cache_keys, count, "cuda")
    scale = ROW_DIM ** -0.5
    floor_us = max(row.flops / floors[0], row.gathered_bytes / floors[1]) * 1e6
    outs, times = {}, {}
    for variant in variants:
        def call(s: SparseInputs, v: Variant | None = variant) -> torch.Tensor:
            return verify_attention(s.q, s.kv_cache, indices=s.indices, causal=False, softmax_scale=scale,
                                    out=s.out, variant=v)
        us = times[variant] = measure(call, sets).us
        outs[variant] = call(sets[0]).float().clone()
        print(f"{row}  {variant.name if variant else 'dispatch':48s} {us:9.1f} µs {row.flops / us / 1e6:7.1f} "
              f"TFLOP/s  {us / floor_us:5.2f}x floor", flush=True)
    if live.module is None:     # main() printed why
        return
    flash = sparse_call(live.module, scale)
    us = measure(flash, sets).us
    diff = (flash(sets[0]).float() - outs[None]).abs().max().item()
    print(f"{row}  {'FlashMLA':48s} {us:9.1f} µs {row.flops / us / 1e6:7.1f} TFLOP/s  "
          f"mlagen / FlashMLA {times[None] / us:5.2f}  max |diff| {diff:.2e}", flush=True)


def parse_args(argv: list[str]):
    p = parser(__file__, __doc__)
    p.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlen-q", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--cache-keys", type=int, default=65536, help="cached keys a request's tokens pick from")
    p.add_argument("--variant", type=variant_name, action="append", default=[],
                   help="a variant to time after the dispatcher's pick (repeatable)")
    p.add_argument("--flashmla", type=Path, metavar="DIR",
                   help="the FlashMLA checkout built with build_flashmla.py (default $MLAGEN_FLASHMLA, else "
                   "./third_party/FlashMLA)")
    args = p.parse_args(argv)
    for name in ("heads", "seqlen_q", "batch"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}, expected values >= 1")
    if not 1 <= args.topk <= args.cache_keys:
        p.error(f"--topk: got {args.topk}, expected 1..--cache-keys={args.cache_keys}")
    return args


def rows(args) -> list[SparseRow]:
    return [SparseRow(h, b, s, args.topk) for h in args.heads for s in args.seqlen_q for b in args.batch]


def main(args) -> None:
    from mlagen.tools.timing import copy_bandwidth, matmul_rate

    floors = (matmul_rate(0), copy_bandwidth(0))
    print(f"{torch.cuda.get_device_name(0)}: bf16 matmul {floors[0] / 1e12:.0f} TFLOP/s, copy "
          f"{floors[1] / 1e12:.2f} TB/s; ds_mla cache, {PAGE_SIZE}-key pages, {args.cache_keys} keys a request",
          flush=True)
    variants: list[Variant | None] = [None, *(parse_variant(n) for n in args.variant)]
    live = load_flashmla(args.flashmla)
    print(f"FlashMLA: {'live, built at ' + live.source if live.module else 'not run: ' + live.reason}", flush=True)
    for row in rows(args):
        run_row(row, args.cache_keys, variants, floors, live)


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    require_gpu(__file__)
    main(arguments)
