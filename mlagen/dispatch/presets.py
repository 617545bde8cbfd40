"""Named problems of the models mlagen is for, and the variants `mlagen emit` writes for them."""

from __future__ import annotations

from dataclasses import dataclass

from ..dsl.spec import Problem, Variant, naive
from .policy import H200, heuristic_mma, transposed_tile, untuned_variant

# Context lengths, short and long, whose dispatch `mlagen emit` covers for one request.
EMIT_KEYS: tuple[int, ...] = (4096, 65536)


@dataclass(frozen=True)
class Preset:
    name: str
    problem: Problem
    description: str
    # Draft lengths the emitted variants must cover: one variant per distinct choice of the
    # dispatcher without a table over these S, for a request of EMIT_KEYS keys each (on sm_90a
    # the long one runs the seesaw schedule), and, where that choice is arch-specific like
    # sm_90a's wgmma, the portable one for the plain arch too; on devices that run sm_90a, the
    # transposed tile where all of a request's rows fit one (the dispatcher's pick for long
    # batched launches of such rows); plus the naive baseline. The dispatcher's choices are those
    # for the H200's SM count (`policy.H200`), the device its thresholds were measured on.
    seqlens_q: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33, 64)

    def variants(self, arch: str) -> list[Variant]:
        chosen = {untuned_variant(self.problem, s, 1, keys, arch, H200) for s in self.seqlens_q for keys in EMIT_KEYS}
        chosen |= {v for s in self.seqlens_q if (v := heuristic_mma(self.problem, s, arch, H200, specialize=False))}
        chosen |= {v for s in self.seqlens_q if (v := transposed_tile(self.problem, s, arch, H200))}
        return [naive(arch=arch)] + sorted(chosen - {naive(arch=arch)}, key=lambda v: v.name)


def _mla(heads: int) -> Problem:
    return Problem(heads=heads, dl=512, dr=64, dtype="bf16", page_size=64, mask="causal", lse=True)


def _sparse(heads: int) -> Problem:
    """DeepSeek Sparse Attention's verify: gathered keys over the ds_mla cache, no mask."""
    return _mla(heads).with_(kv_format="ds_mla", keys="gathered", mask="none")


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("kimi-k2", _mla(64), "Kimi K2: 64 heads, one GPU"),
        Preset("kimi-k2-tp8", _mla(8), "Kimi K2 sharded 8 ways: 8 heads per GPU"),
        Preset("deepseek-v3", _mla(128), "DeepSeek-V3/R1: 128 heads, one GPU"),
        Preset("deepseek-v3-tp4", _mla(32), "DeepSeek-V3 sharded 4 ways: 32 heads per GPU"),
        Preset("deepseek-v3-tp8", _mla(16), "DeepSeek-V3 sharded 8 ways: 16 heads per GPU"),
        Preset("kimi-k2-fp8", _mla(64).with_(kv_format="e4m3"),
               "Kimi K2 over a flat e4m3 cache (kv_scale): 64 heads"),
        Preset("deepseek-v3-fp8", _mla(128).with_(kv_format="ds_mla"),
               "DeepSeek-V3 over FlashMLA's 656-byte FP8 rows: 128 heads"),
        Preset("deepseek-v3.2", _sparse(128),
               "DeepSeek-V3.2 sparse verify (top-k rows per token) over the 656-byte FP8 rows: 128 heads"),
        Preset("deepseek-v3.2-tp8", _sparse(16),
               "DeepSeek-V3.2 sparse verify sharded 8 ways: 16 heads per GPU"),
    )
}
DEFAULT_PRESET = "kimi-k2"
DEFAULT_EMIT_ARCHS: tuple[str, ...] = ("sm_90", "sm_120")


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: got {name!r}, expected one of {', '.join(PRESETS)}") from None
