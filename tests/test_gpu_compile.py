"""GPU tests of the custom op under torch.compile and under the CUDA graph captures engines make.

Every compiled or replayed result equals the eager op's, bit for bit, on the same inputs and the
same variant: torch.compile's three modes (`reduce-overhead`'s CUDA graph trees included: warm-up,
recording, replays, and a new graph when the batch size changes), `dynamic=True` over changing
batch sizes and lengths, and engine-style captures (one graph per batch size in one shared pool,
replayed in random order with fresh inputs copied into static buffers). The variants cover the
split workspace (kept per stream, counters from an arena), an unsplit kernel and a TMA kernel
(whose cache descriptor lives in device memory), with and without lse, over a bf16 and an e4m3
cache. One round per test is also checked against the fp64 reference.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import mlagen
from mlagen.dsl.spec import Variant
from mlagen.runtime.op import device_info
from mlagen.tools.testing import assert_rows_match, make_case, tolerance

pytestmark = pytest.mark.gpu

HEADS, S, PAGE = 64, 5, 64


def _variant(kind: str) -> str:
    """The variant of `kind` for this GPU: "unsplit" (one key range), "split" (a fixed 3-way
    split: partials in the workspace, merged through counters) or "split_tma" (the same with TMA
    loads, on sm_90)."""
    arch = device_info(torch.cuda.current_device())[0]
    if kind == "split_tma" and arch != "sm_90":
        pytest.skip(f"TMA loads need sm_90; this GPU is {arch}")
    base = Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=2,
                   arch="sm_90a" if arch == "sm_90" else arch)
    split = dict(unsplit=dict(kv_split=1), split=dict(kv_split=3), split_tma=dict(kv_split=3, loads="tma"))[kind]
    return dataclasses.replace(base, **split).name


def _step(variant: str | None, return_lse: bool):
    """What a model's verify step does around the op: attention, then arithmetic on its results."""
    def step(q, kv_cache, block_table, cache_seqlens, tree_mask, kv_scale, softmax_scale):
        result = mlagen.verify_attention_op(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale,
                                            tree_mask=tree_mask, return_lse=return_lse, variant=variant,
                                            kv_scale=kv_scale)
        if return_lse:
            return result[0].float() * 2, result[1] + 1
        return (result.float() * 2,)
    return step


def _case(batch: int, prefixes: list[int], kv: str, seed: int):
    return make_case(batch=batch, seqlen_q=S, heads=HEADS, prefixes=prefixes, page_size=PAGE, mask="tree",
                     seed=seed, per_request_tree=True, kv_format="dtype" if kv == "bf16" else kv)


def _args(case) -> tuple:
    return (case.q, case.kv_cache, case.block_table, case.cache_seqlens, case.tree_mask, case.kv_scale, case.scale)


def _check_reference(case, results: tuple, return_lse: bool) -> None:
    ref_out, ref_lse = case.reference(torch.float64)
    lse = (results[1] - 1).transpose(1, 2) if return_lse else None
    assert_rows_match(results[0] / 2, lse, ref_out, ref_lse.transpose(1, 2), tolerance(torch.bfloat16))


def _run_against_eager(compiled, eager, cases: list, return_lse: bool) -> None:
    """Each case in turn through `compiled` and `eager`, with fresh queries each time: the results
    are equal bit for bit. Compiled results are cloned at once (graph trees reuse their output
    memory on the next replay)."""
    for i, case in enumerate(cases):
        case = dataclasses.replace(case, q=torch.randn_like(case.q))
        got = tuple(t.clone() for t in compiled(*_args(case)))
        want = eager(*_args(case))
        assert len(got) == len(want) == (2 if return_lse else 1)
        for name, g, w in zip(("out", "lse"), got, want, strict=False):
            assert torch.equal(g, w), f"call {i} (batch {case.q.shape[0]}): {name} differs from eager"
        if i == 0:
            _check_reference(case, want, return_lse)


# warm-up, recording, replays; a new batch size (graph trees record a new graph); the first again
_BATCHES = ((2, [300, 1200]), (2, [300, 1200]), (2, [300, 1200]), (2, [300, 1200]),
            (5, [40, 0, 2000, 700, 64]), (5, [40, 0, 2000, 700, 64]), (5, [40, 0, 2000, 700, 64]),
            (2, [300, 1200]))


def _compiled_matches_eager(mode: str, kind: str, return_lse: bool, kv: str) -> None:
    torch._dynamo.reset()
    step = _step(_variant(kind), return_lse)
    compiled = torch.compile(step, fullgraph=True, mode=mode)
    cases = {}
    for batch, prefixes in _BATCHES:
        cases.setdefault(batch, _case(batch, prefixes, kv, seed=batch))
    _run_against_eager(compiled, step, [cases[batch] for batch, _ in _BATCHES], return_lse)


@pytest.mark.parametrize("kv", ["bf16", "e4m3"])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("kind", ["unsplit", "split", "split_tma"])
def test_reduce_overhead_matches_eager(kind, return_lse, kv):
    """CUDA graph trees: the workspace and descriptors the op keeps across calls live outside the
    trees' pool, so warm-up, recording and replays all run, and equal eager."""
    if kind == "split_tma" and kv != "bf16":
        pytest.skip("TMA loads read 16-bit caches only")
    _compiled_matches_eager("reduce-overhead", kind, return_lse, kv)


def test_reduce_overhead_with_a_static_cache():
    """A cache marked static with torch._dynamo.mark_static_address (which spares the graph trees
    a copy of it before each replay): results equal eager as its contents change in place between
    calls."""
    torch._dynamo.reset()
    step = _step(_variant("split"), True)
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    case = _case(3, [900, 0, 2500], "bf16", seed=21)
    torch._dynamo.mark_static_address(case.kv_cache)
    for i in range(4):
        valid = ~case.kv_cache.isnan()
        case.kv_cache.copy_(torch.where(valid, torch.randn_like(case.kv_cache), case.kv_cache))
        got = tuple(t.clone() for t in compiled(*_args(case)))
        want = step(*_args(case))
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), f"call {i}"


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
@pytest.mark.parametrize("kind,return_lse,kv", [
    ("unsplit", False, "bf16"), ("split", True, "bf16"), ("split_tma", True, "bf16"), ("split", True, "e4m3"),
])
def test_other_compile_modes_match_eager(mode, kind, return_lse, kv):
    _compiled_matches_eager(mode, kind, return_lse, kv)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_dynamic_shapes_match_eager(mode):
    """dynamic=True: one compiled graph over changing batch sizes and lengths, the dispatcher's pick
    (the same in both, given the same shapes)."""
    torch._dynamo.reset()
    step = _step(None, True)
    compiled = torch.compile(step, fullgraph=True, mode=mode, dynamic=True)
    shapes = [(1, [70]), (3, [500, 0, 9000]), (8, [100 * b for b in range(8)]), (2, [4000, 33]), (6, [1] * 6),
              (3, [500, 0, 9000])]
    cases = [_case(batch, prefixes, "bf16", seed=10 + i) for i, (batch, prefixes) in enumerate(shapes)]
    _run_against_eager(compiled, step, cases, True)


def test_engine_style_captures_replay_in_any_order():
    """One graph per batch size, all in one shared memory pool, captured after a warm-up call each;
    then replayed in random order, each time with fresh queries, lengths, page tables and cache
    contents copied into the static buffers, and compared with an eager call on the same buffers.
    The dispatcher picks per batch size: the small batches split their keys (workspace from the
    per-stream buffers and, under capture, the arena), the large ones do not."""
    batches, max_keys, pages = (1, 2, 4, 8), 3000, 512
    max_pages = -(-max_keys // PAGE)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_cache = torch.empty(pages, PAGE, 576, dtype=torch.bfloat16, device="cuda")
    scale = 576 ** -0.5
    static, graphs, pool = {}, {}, torch.cuda.graph_pool_handle()

    def fill(bufs: dict, batch: int, rng: random.Random) -> None:
        """Fresh inputs in the static buffers: NaN in every page no request owns and in every key
        past a request's length."""
        bufs["q"].normal_(generator=gen)
        lengths = torch.tensor([rng.randint(S, max_keys) for _ in range(batch)], device="cuda")
        bufs["cache_seqlens"].copy_(lengths)
        table = torch.randperm(pages, generator=gen, device="cuda")[: batch * max_pages].view(batch, max_pages)
        bufs["block_table"].copy_(table)
        kv_cache.fill_(math.nan)
        owned = torch.randn(batch, max_pages, PAGE, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
        past = torch.arange(max_pages * PAGE, device="cuda").view(max_pages, PAGE) >= lengths[:, None, None]
        kv_cache[table] = owned.masked_fill(past[..., None], math.nan)

    def call(bufs: dict):
        return mlagen.verify_attention(bufs["q"], kv_cache, bufs["block_table"], bufs["cache_seqlens"],
                                       softmax_scale=scale, causal=True, return_lse=True)

    rng = random.Random(0)
    for batch in batches:
        bufs = static[batch] = dict(q=torch.empty(batch, S, HEADS, 576, dtype=torch.bfloat16, device="cuda"),
                                    block_table=torch.empty(batch, max_pages, dtype=torch.int32, device="cuda"),
                                    cache_seqlens=torch.empty(batch, dtype=torch.int32, device="cuda"))
        fill(bufs, batch, rng)
        call(bufs)                                  # warm-up: compiles and loads outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            bufs["out"], bufs["lse"] = call(bufs)
        graphs[batch] = graph
    order = [rng.choice(batches) for _ in range(16)]
    assert set(order) == set(batches)
    for i, batch in enumerate(order):
        bufs = static[batch]
        fill(bufs, batch, rng)
        graphs[batch].replay()
        out, lse = call(bufs)
        assert torch.equal(bufs["out"], out) and torch.equal(bufs["lse"], lse), f"replay {i} (batch {batch})"
        if i == 0:
            ref_out, ref_lse = mlagen.reference(bufs["q"], kv_cache, bufs["block_table"], bufs["cache_seqlens"],
                                                softmax_scale=scale, causal=True, dtype=torch.float64)
            assert_rows_match(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2), tolerance(torch.bfloat16))
