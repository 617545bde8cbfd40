"""Context-parallel shards (`mlagen.runtime.context_parallel`): the local lengths, the local ->
global positions and the shard masks against brute-force enumeration on the CPU; the shards'
results, merged with `merge_states`, against the unsharded problem (the fp64 reference on the
CPU, the op and the reference on the GPU); argument errors; examples/context_parallel.py."""

from __future__ import annotations

import functools
import itertools
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scripts import load_script

import mlagen
from mlagen.runtime import context_parallel, varlen
from mlagen.runtime.reference import reference, visible_keys
from mlagen.tools.testing import (
    assert_rows_match,
    make_case,
    mismatch,
    poison_allocator,
    random_tree,
)

ROOT = Path(__file__).resolve().parent.parent
WORLDS = [1, 2, 3, 4, 8]
INTERLEAVES = [1, 2, 16]
MASKS = ["causal", "tree", "none"]


def _rank_tokens(length: int, rank: int, world: int, interleave: int) -> list[int]:
    """The global tokens of `rank`, in order, by enumeration."""
    return [t for t in range(length) if (t // interleave) % world == rank]


def _layout(rank: int, world: int, interleave: int) -> dict:
    return dict(rank=rank, world=world, interleave=interleave)


# ---- CPU: lengths, positions and masks against enumeration

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("interleave", INTERLEAVES)
def test_local_lengths_and_positions_match_enumeration(world, interleave):
    lengths = sorted({0, 1, 2, interleave - 1, interleave, interleave + 1, world * interleave - 1,
                      world * interleave, world * interleave + 3, 3 * world * interleave + interleave // 2, 1000})
    lengths = [n for n in lengths if n >= 0]
    N = torch.tensor(lengths, dtype=torch.int32)
    owned: list[list[int]] = [[] for _ in lengths]
    for rank in range(world):
        local = mlagen.cp_local_seqlens(N, **_layout(rank, world, interleave))
        assert local.dtype == torch.int32 and local.shape == N.shape
        for b, n in enumerate(lengths):
            tokens = _rank_tokens(n, rank, world, interleave)
            assert int(local[b]) == len(tokens), (rank, n)
            got = mlagen.cp_global_positions(torch.arange(len(tokens)), **_layout(rank, world, interleave))
            assert got.tolist() == tokens, (rank, n)
            owned[b] += tokens
    for b, n in enumerate(lengths):                         # the ranks' tokens partition 0..N-1
        assert sorted(owned[b]) == list(range(n))


def _expected_mask(N: list[int], seqlen_q: int, rank: int, world: int, interleave: int, causal: bool,
                   trees: list[torch.Tensor | None], counts: list[int]) -> torch.Tensor:
    """[B, S, S] by brute force: query i of request b sees local key n_r - s_b + k by the global
    visibility of its token (`reference.visible_keys` over the unsharded request)."""
    out = torch.zeros(len(N), seqlen_q, seqlen_q, dtype=torch.bool)
    for b, n in enumerate(N):
        tokens = _rank_tokens(n, rank, world, interleave)
        s = counts[b]
        tree = trees[b][:s, :s] if trees[b] is not None else None
        seen = visible_keys(n, s, causal, tree)                           # [s, n]
        for i in range(s):
            for k in range(s):
                j = len(tokens) - s + k
                out[b, i, k] = j >= 0 and bool(seen[i, tokens[j]])
    return out


LENGTHS = [0, 1, 4, 9, 10, 17, 30, 35, 36, 37, 100, 257]        # S = 9: empty, N < S, N < S W, long


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("interleave", INTERLEAVES)
@pytest.mark.parametrize("mask", MASKS)
def test_shard_masks_match_global_visibility(world, interleave, mask):
    S = 9
    gen = torch.Generator().manual_seed(world * 100 + interleave)
    N = torch.tensor(LENGTHS, dtype=torch.int32)
    per_request = torch.stack([random_tree(S, gen) for _ in LENGTHS])
    for tree in ([None] if mask != "tree" else [per_request, per_request[3]]):
        trees = [None] * len(LENGTHS) if tree is None else list(tree if tree.dim() == 3 else [tree] * len(LENGTHS))
        for rank in range(world):
            got = mlagen.cp_shard_mask(N, S, **_layout(rank, world, interleave), causal=mask == "causal",
                                       tree_mask=tree)
            if mask == "none":
                assert got is None
                continue
            assert got.dtype == torch.bool and got.shape == (len(LENGTHS), S, S) and got.is_contiguous()
            want = _expected_mask(LENGTHS, S, rank, world, interleave, mask == "causal", trees, [S] * len(LENGTHS))
            assert torch.equal(got, want), (rank, tree is not None and tree.dim())


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (3, 2), (4, 16), (8, 1)])
@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_varlen_shard_masks_match_global_visibility(world, interleave, mask):
    """With draft counts, each request's s_b x s_b block top-left, False elsewhere."""
    S = 9
    counts = [0, 1, 9, 4, 9, 2, 7, 3, 9, 5, 1, 6]
    gen = torch.Generator().manual_seed(7)
    tree = torch.stack([random_tree(S, gen) for _ in LENGTHS]) if mask == "tree" else None
    N = torch.tensor(LENGTHS, dtype=torch.int32)
    for rank in range(world):
        got = mlagen.cp_shard_mask(N, S, **_layout(rank, world, interleave), causal=mask == "causal",
                                   tree_mask=tree, draft_counts=torch.tensor(counts, dtype=torch.int32))
        want = _expected_mask(LENGTHS, S, rank, world, interleave, mask == "causal",
                              list(tree) if tree is not None else [None] * len(LENGTHS), counts)
        assert torch.equal(got, want), rank


def test_world_of_one_gives_the_core_masks():
    """One rank holds every key: the shard mask is the op's own mask over the last S keys."""
    S = 9
    N = torch.tensor([9, 40, 300], dtype=torch.int32)
    causal = mlagen.cp_shard_mask(N, S, rank=0, world=1, interleave=4)
    assert torch.equal(causal, torch.ones(S, S, dtype=torch.bool).tril().expand(3, S, S))
    tree = random_tree(S, torch.Generator().manual_seed(1))
    assert torch.equal(mlagen.cp_shard_mask(N, S, rank=0, world=1, tree_mask=tree), tree.expand(3, S, S))


def test_builders_read_no_values():
    """Lengths, masks and the cache's shard come from tensor ops alone (no host reads, so the
    shard's call can be captured in a CUDA graph): they run on meta tensors, which have no data."""
    N = torch.empty(4, dtype=torch.int32, device="meta")
    tree = torch.empty(4, 9, 9, dtype=torch.bool, device="meta")
    layout = _layout(1, 4, 2)
    assert mlagen.cp_local_seqlens(N, **layout).shape == (4,)
    assert mlagen.cp_shard_mask(N, 9, **layout, tree_mask=tree).shape == (4, 9, 9)
    assert mlagen.cp_shard_mask(N, 9, **layout, draft_counts=N).shape == (4, 9, 9)
    kv = torch.empty(10, 16, 80, device="meta")
    table = torch.empty(4, 5, dtype=torch.int32, device="meta")
    local_kv, local_table, local_n = mlagen.cp_shard_cache(kv, table, N, **layout)
    # 80 keys a request, 24 of them this rank's at most (3 cycles of 8): 2 pages of 16.
    assert local_kv.shape == (8, 16, 80) and local_table.shape == (4, 2) and local_n.shape == (4,)


# ---- shards of a case, their merge

def _scatter(kv: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, gen: torch.Generator,
             spare: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A shard's cache (`cp_shard_cache`: request b on pages b * P ..) moved to pages in random
    order among `spare` NaN pages, with NaN in each request's rows past its length and block-table
    entries past its pages pointing at NaN pages: a kernel that reads anything it must not shows
    NaN."""
    pages, page_size, D = kv.shape
    B, P = table.shape
    rows = kv.reshape(B, P * page_size, D).clone()
    rows[torch.arange(P * page_size, device=kv.device)[None, :] >= lengths[:, None].long()] = math.nan
    order = torch.randperm(pages + spare, generator=gen).to(kv.device)
    moved = torch.full((pages + spare, page_size, D), math.nan, dtype=kv.dtype, device=kv.device)
    moved[order[:pages]] = rows.reshape(pages, page_size, D)
    used = (lengths.long() + page_size - 1) // page_size
    nan_pages = order[pages:][torch.randint(0, spare, (B, P), generator=gen).to(kv.device)]
    col = torch.arange(P, device=kv.device)[None, :]
    return moved, torch.where(col < used[:, None], order[table.long()], nan_pages).to(torch.int32)


def _case(mask: str, seed: int, device: str, *, heads: int, page_size: int, dl: int = 512, dr: int = 64):
    """A batch of 6 requests of S = 9 draft tokens: one empty, one N = 4 < S, one N = S, short ones
    under S W and a long one; per-request trees."""
    case = make_case(batch=6, seqlen_q=9, heads=heads, prefixes=[0, 0, 0, 20, 150, 1300], page_size=page_size,
                     mask=mask, seed=seed, device=device, dl=dl, dr=dr, empty=[True] + [False] * 5,
                     per_request_tree=True)
    case.cache_seqlens[1] = 4
    return case


def _merge(results: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' (out, lse) merged with merge_states, in fp32."""
    first, *rest = results
    return functools.reduce(lambda acc, r: mlagen.merge_states(*acc, *r), rest, (first[0].float(), first[1].float()))


class ReferenceOp:
    """The op with the fp64 reference as its kernel, for CPU tensors: what `verify_attention`
    computes, with the calls' max_seqlen_k recorded. It has the kernels' mask semantics, N < S
    included, and reads nothing past a request's length."""

    def __init__(self) -> None:
        self.bounds: list[int | None] = []

    def __call__(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale=None, causal=True, tree_mask=None,
                 return_lse=False, head_dim_v=512, max_seqlen_k=None, **ignored):
        self.bounds.append(max_seqlen_k)
        out, lse = reference(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale, causal=causal,
                             tree_mask=tree_mask, head_dim_v=head_dim_v, dtype=torch.float64)
        return (out, lse) if return_lse else out


@pytest.fixture
def reference_op(monkeypatch) -> ReferenceOp:
    """The shard functions and varlen's padding call the reference instead of the kernels."""
    op = ReferenceOp()
    monkeypatch.setattr(context_parallel, "verify_attention", op)
    monkeypatch.setattr(varlen, "verify_attention", op)
    return op


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("interleave", INTERLEAVES)
@pytest.mark.parametrize("mask", MASKS)
def test_shards_merge_to_the_unsharded_reference(world, interleave, mask, reference_op):
    """On the CPU, the reference standing in for the kernels: every rank's verify_attention_cp_shard
    on its scattered, NaN-poisoned shard, merged over the ranks, is the unsharded result."""
    case = _case(mask, world * 10 + interleave, "cpu", heads=2, page_size=16, dl=64, dr=16)
    gen = torch.Generator().manual_seed(world)
    results = []
    for rank in range(world):
        layout = _layout(rank, world, interleave)
        kv, table, local = mlagen.cp_shard_cache(case.kv_cache, case.block_table, case.cache_seqlens, **layout)
        assert torch.equal(local, mlagen.cp_local_seqlens(case.cache_seqlens, **layout))
        kv, table = _scatter(kv, table, local, gen)
        results.append(mlagen.verify_attention_cp_shard(case.q, kv, table, case.cache_seqlens, **layout,
                                                        max_seqlen_k=1309, **case.kwargs()))
        assert reference_op.bounds[-1] == mlagen.cp_local_seqlens(torch.tensor([1309]), **layout).item()
    out, lse = _merge(results)
    ref_out, ref_lse = case.reference(torch.float64)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    seen = ~torch.isneginf(ref_lse)
    assert torch.allclose(lse[seen], ref_lse[seen].float(), atol=1e-5, rtol=1e-6)
    assert torch.allclose(out, ref_out.float(), atol=1e-5, rtol=1e-5)


def _varlen_case(mask: str, device: str, **shape):
    """The dense case cut to draft counts s_b = [0, 1, 9, 4, 2, 7] and global lengths prefix + s_b,
    but N = 5 < s_b for the third request: (case, packed queries, lengths, cu_seqlens_q). The
    case's tree (per request) is the packed mask, top-left."""
    case = _case(mask, 5, device, **shape)
    counts = [0, 1, 9, 4, 2, 7]
    lengths = torch.tensor([0, 1, 5, 24, 152, 1307], dtype=torch.int32, device=device)
    q = torch.cat([case.q[b, :s] for b, s in enumerate(counts)])
    cu = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=device)
    return case, q, lengths, cu


def _varlen_shards(case, q, lengths, cu, world: int, interleave: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's (out, lse) from verify_attention_varlen_cp_shard on its scattered shard."""
    gen = torch.Generator().manual_seed(world)
    results = []
    for rank in range(world):
        layout = _layout(rank, world, interleave)
        kv, table, local = mlagen.cp_shard_cache(case.kv_cache, case.block_table, lengths, **layout)
        kv, table = _scatter(kv, table, local, gen)
        results.append(mlagen.verify_attention_varlen_cp_shard(
            q, kv, table, lengths, cu, 9, **layout, softmax_scale=case.scale, causal=case.causal,
            tree_mask=case.tree_mask, head_dim_v=case.dl))
    return results


@pytest.mark.parametrize("world,interleave", [(2, 1), (3, 2), (4, 16), (8, 1)])
@pytest.mark.parametrize("mask", MASKS)
def test_varlen_shards_merge_to_the_unsharded_reference(world, interleave, mask, reference_op):
    case, q, lengths, cu = _varlen_case(mask, "cpu", heads=2, page_size=16, dl=64, dr=16)
    out, lse = _merge(_varlen_shards(case, q, lengths, cu, world, interleave))
    ref_out, ref_lse = mlagen.verify_attention_varlen(q, case.kv_cache, case.block_table, lengths, cu, 9,
                                                      return_lse=True, **case.kwargs())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert torch.allclose(out, ref_out.float(), atol=1e-5, rtol=1e-5)


# ---- CPU: argument errors, named before any launch

def _cpu_args(**over):
    q = torch.zeros(2, 9, 4, 576, dtype=torch.bfloat16)
    args = dict(q=q, kv_cache=torch.zeros(4, 16, 576, dtype=torch.bfloat16),
                block_table=torch.zeros(2, 2, dtype=torch.int32),
                cache_seqlens=torch.tensor([20, 9], dtype=torch.int32), rank=0, world=2)
    args.update(over)
    return args


@pytest.mark.parametrize("over,name", [
    (dict(world=0), "world"),
    (dict(world=2.0), "world"),
    (dict(interleave=0), "interleave"),
    (dict(interleave=True), "interleave"),
    (dict(rank=2), "rank"),
    (dict(rank=-1), "rank"),
    (dict(rank=True), "rank"),
    (dict(cache_seqlens=torch.tensor([20.0, 9.0])), "cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([20, 9])), "cache_seqlens.dtype"),
    (dict(cache_seqlens=torch.tensor([20, 9, 3], dtype=torch.int32)), "cache_seqlens.shape"),
    (dict(cache_seqlens=torch.tensor([20, 9], dtype=torch.int32, device="meta")), "cache_seqlens"),
    (dict(tree_mask=torch.ones(8, 8, dtype=torch.bool)), "tree_mask.shape"),
    (dict(tree_mask=torch.ones(9, 9)), "tree_mask"),
    (dict(q=torch.zeros(2, 65, 4, 576, dtype=torch.bfloat16)), "q.shape[1]"),
    (dict(q=torch.zeros(9, 4, 576, dtype=torch.bfloat16)), "q.shape"),
    (dict(max_seqlen_k=-1), "max_seqlen_k"),
    (dict(check_values=True, cache_seqlens=torch.tensor([20, -1], dtype=torch.int32)), "cache_seqlens[1]"),
])
def test_shard_arguments_are_checked_by_name(over, name):
    args = _cpu_args(**over)
    with pytest.raises(mlagen.InputError, match=rf"^{re.escape(name)}: "):
        mlagen.verify_attention_cp_shard(args.pop("q"), args.pop("kv_cache"), args.pop("block_table"),
                                         args.pop("cache_seqlens"), **args)


def test_checked_shards_reach_the_op():
    """Arguments the shard accepts go on to the op, whose own checks then run (a CPU q here); a
    mask of none runs as no mask, so S may pass 64."""
    for over in ({}, dict(causal=False, q=torch.zeros(2, 65, 4, 576, dtype=torch.bfloat16)), dict(max_seqlen_k=7)):
        args = _cpu_args(**over)
        with pytest.raises(mlagen.InputError, match=r"^q\.device: "):
            mlagen.verify_attention_cp_shard(args.pop("q"), args.pop("kv_cache"), args.pop("block_table"),
                                             args.pop("cache_seqlens"), **args)


@pytest.mark.parametrize("over,name", [
    (dict(q=torch.zeros(2, 9, 4, 576, dtype=torch.bfloat16)), "q.shape"),
    (dict(cu_seqlens_q=[0, 9, 18]), "cu_seqlens_q"),
    (dict(max_seqlen_q=0), "max_seqlen_q"),
    (dict(max_seqlen_q=65), "q.shape[1]"),
    (dict(tree_mask=torch.ones(2, 9, 8, dtype=torch.bool)), "tree_mask.shape"),
    (dict(world=-3), "world"),
    (dict(cache_seqlens=torch.tensor([20], dtype=torch.int32)), "cache_seqlens.shape"),
])
def test_varlen_shard_arguments_are_checked_by_name(over, name):
    args = dict(q=torch.zeros(18, 4, 576, dtype=torch.bfloat16), kv_cache=torch.zeros(4, 16, 576, dtype=torch.bfloat16),
                block_table=torch.zeros(2, 2, dtype=torch.int32),
                cache_seqlens=torch.tensor([20, 9], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 9, 18], dtype=torch.int32), max_seqlen_q=9, rank=1, world=2)
    args.update(over)
    with pytest.raises(mlagen.InputError, match=rf"^{re.escape(name)}: "):
        positional = [args.pop(k) for k in ("q", "kv_cache", "block_table", "cache_seqlens", "cu_seqlens_q",
                                            "max_seqlen_q")]
        mlagen.verify_attention_varlen_cp_shard(*positional, **args)


def test_builders_check_their_layout():
    N = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(mlagen.InputError, match=r"^rank: "):
        mlagen.cp_local_seqlens(N, rank=3, world=3)
    with pytest.raises(mlagen.InputError, match=r"^interleave: "):
        mlagen.cp_global_positions(torch.arange(3), rank=0, world=1, interleave=0)
    with pytest.raises(mlagen.InputError, match=r"^cache_seqlens: "):
        mlagen.cp_shard_mask(torch.tensor([[5]]), 9, rank=0, world=2)


# ---- the guide's snippet and the example

def test_guide_context_parallel_example_runs():
    """The guide's context-parallel session, run as a doctest (CPU tensors)."""
    import doctest

    guide = (ROOT / "docs" / "guide.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", guide, re.S) if "cp_local_seqlens" in b and ">>>" in b)
    test = doctest.DocTestParser().get_doctest(block, {}, "guide.md context parallelism", "guide.md", 0)
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.failures == 0 and runner.tries >= 3


def _example():
    return load_script("examples/context_parallel.py")


def test_example_skips_without_two_gpus(monkeypatch, capsys):
    example = _example()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert example.main(["--interleave", "16", "--mask", "tree"]) == 0
    assert capsys.readouterr().out == "context_parallel.py skipped: it needs at least 2 CUDA GPUs, 1 visible\n"


def test_example_checks_its_arguments(capsys):
    example = _example()
    args = example.parse_args(["--interleave", "4", "--mask", "none", "--batch", "2"])
    assert (args.interleave, args.mask, args.batch, args.seqlen_q) == (4, "none", 2, 9)
    for bad in (["--interleave", "0"], ["--mask", "diagonal"], ["--heads", "x"]):
        with pytest.raises(SystemExit) as done:
            example.parse_args(bad)
        assert done.value.code == 2
    assert "usage: context_parallel.py" in capsys.readouterr().err


# ---- GPU: the shards through the kernels

gpu = pytest.mark.gpu


def _shards(case, world: int, interleave: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's (out, lse) from verify_attention_cp_shard on its scattered, NaN-poisoned shard."""
    gen = torch.Generator().manual_seed(seed)
    results = []
    for rank in range(world):
        layout = _layout(rank, world, interleave)
        kv, table, local = mlagen.cp_shard_cache(case.kv_cache, case.block_table, case.cache_seqlens, **layout)
        kv, table = _scatter(kv, table, local, gen)
        poison_allocator(16 << 20)
        results.append(mlagen.verify_attention_cp_shard(case.q, kv, table, case.cache_seqlens, **layout,
                                                        **case.kwargs()))
    return results


@gpu
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("mask", MASKS)
def test_shards_merge_to_the_unsharded_op(world, interleave, mask):
    """Each rank's shard on shuffled pages among NaN ones; lengths from empty and N < S to N < S W
    and long. The merge matches the unsharded op and the fp64 reference row by row, and a row that
    sees no key anywhere is exactly 0 with lse -inf."""
    page = 16 if interleave == 1 else 64
    case = _case(mask, world * 10 + interleave, "cuda", heads=16, page_size=page)
    out, lse = _merge(_shards(case, world, interleave, seed=world))
    torch.cuda.synchronize()
    unsharded, unsharded_lse = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                                       return_lse=True, **case.kwargs())
    assert_rows_match(out.to(case.q.dtype), lse.transpose(1, 2), unsharded, unsharded_lse.transpose(1, 2))
    problem = mismatch(out.to(case.q.dtype), lse, case)
    assert problem is None, problem


@gpu
@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 2), (8, 16)])
@pytest.mark.parametrize("mask", MASKS)
def test_varlen_shards_merge_to_the_unsharded_op(world, interleave, mask, monkeypatch):
    case, q, lengths, cu = _varlen_case(mask, "cuda", heads=16, page_size=16)
    out, lse = _merge(_varlen_shards(case, q, lengths, cu, world, interleave))   # [total_q, H, Dl], [H, total_q]
    out = out.to(q.dtype)
    unsharded, unsharded_lse = mlagen.verify_attention_varlen(q, case.kv_cache, case.block_table, lengths, cu, 9,
                                                              return_lse=True, **case.kwargs())
    assert_rows_match(out, lse.T, unsharded, unsharded_lse.T, dims=("row", "h"))
    monkeypatch.setattr(varlen, "verify_attention", ReferenceOp())       # the fp64 reference, padded as varlen pads
    ref_out, ref_lse = mlagen.verify_attention_varlen(q, case.kv_cache, case.block_table, lengths, cu, 9,
                                                      return_lse=True, **case.kwargs())
    assert_rows_match(out, lse.T, ref_out, ref_lse.T, dims=("row", "h"))


@gpu
def test_shard_call_is_captured_in_a_cuda_graph():
    """The shard's lengths and mask are built on the device: the whole call captures in a CUDA
    graph, and a replay with other global lengths gives the eager result."""
    case = _case("tree", 3, "cuda", heads=16, page_size=64)
    layout = _layout(1, 4, 2)
    kv, table, _ = mlagen.cp_shard_cache(case.kv_cache, case.block_table, case.cache_seqlens, **layout)
    lengths = case.cache_seqlens.clone()
    eager = mlagen.verify_attention_cp_shard(case.q, kv, table, lengths, **layout, **case.kwargs())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mlagen.verify_attention_cp_shard(case.q, kv, table, lengths, **layout, **case.kwargs())
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert torch.equal(got, want)
    lengths.copy_((case.cache_seqlens - 7).clamp(min=0))
    graph.replay()
    eager = mlagen.verify_attention_cp_shard(case.q, kv, table, lengths, **layout, **case.kwargs())
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert torch.equal(got, want)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or shutil.which("torchrun") is None,
                    reason="the example needs 2 CUDA GPUs and torchrun")
@pytest.mark.parametrize("options", [[], ["--interleave", "16", "--mask", "tree"]])
def test_example_runs_under_torchrun(options):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "context_parallel.py"), *options],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": ok") == 2, done.stdout
