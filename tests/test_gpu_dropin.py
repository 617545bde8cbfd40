"""GPU tests of the drop-in pieces: varlen, merge_states, the custom op under torch.compile and
CUDA graphs, the FlashMLA-compatible API (FlashMLA's dense-decoding test grid with several KV heads
and attention sinks, against mlagen's fp64 reference with FlashMLA's tolerances) and the C++
launcher example."""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dropin_cases import (
    FLASH_MLA_GRID,
    FLASH_MLA_SINKS,
    FLASH_MLA_ZERO_LENGTH,
    FlashMLAParams,
    draft_only,
    flash_mla_case,
    flash_mla_mismatch,
    flash_mla_reference,
    flash_mla_shape,
    per_request_reference,
    prefix_only,
    ragged_case,
)

import mlagen
from mlagen.compat import flash_mla
from mlagen.tools.testing import assert_rows_match, make_case, tolerance

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


def _close(out, lse, ref_out, ref_lse, dtype=torch.bfloat16):
    """Every row of out against the fp64 reference (`mlagen.tools.testing.compare_rows`, with the
    tolerance of `dtype` inputs): out [B, S, H, Dl] with lse [B, H, S], or a varlen out [T, H, Dl]
    with lse [H, T]."""
    if out.dim() == 4:
        lse, ref_lse, dims = lse.transpose(1, 2), ref_lse.transpose(1, 2), ("b", "i", "h")
    else:
        lse, ref_lse, dims = lse.T, ref_lse.T, ("t", "h")
    assert_rows_match(out, lse, ref_out, ref_lse, tolerance(dtype, out.dtype), dims)


@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
@pytest.mark.parametrize("counts,prefixes", [
    ([1, 5, 3, 1, 9], [40, 0, 1000, 3, 200]),
    ([1], [77]),
    ([4, 0, 2, 1], [9, 30, 0, 3]),
    ([33, 1, 17], [4000, 65, 0]),
])
def test_varlen_matches_per_request_reference(mask, counts, prefixes):
    q, case, cu, tree = ragged_case(counts, prefixes, heads=16, mask=mask, seed=7, page_size=64,
                                    dtype=torch.bfloat16, device="cuda")
    out, lse = mlagen.verify_attention_varlen(q, case.kv_cache, case.block_table, case.cache_seqlens,
                                              cu, max(counts), softmax_scale=case.scale,
                                              causal=case.causal, tree_mask=tree, return_lse=True)
    ref_out, ref_lse = per_request_reference(q, case, cu, tree)
    assert out.shape == (sum(counts), 16, 512) and lse.shape == (16, sum(counts))
    _close(out, lse, ref_out, ref_lse)


def test_varlen_in_cuda_graph():
    counts = [3, 1, 6]
    q, case, cu, tree = ragged_case(counts, [100, 0, 500], heads=8, mask="tree", seed=2, page_size=16,
                                    dtype=torch.bfloat16, device="cuda")
    args = (case.kv_cache, case.block_table, case.cache_seqlens, cu, 6)
    kwargs = dict(softmax_scale=case.scale, tree_mask=tree, return_lse=True)
    eager = mlagen.verify_attention_varlen(q, *args, **kwargs)      # compiles and loads
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mlagen.verify_attention_varlen(q, *args, **kwargs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_merge_prefix_and_draft_parts(mask):
    case = make_case(batch=3, seqlen_q=8, heads=16, prefixes=[300, 0, 2000], page_size=64, mask=mask,
                     seed=4, per_request_tree=True)
    kw = dict(return_lse=True)
    parts = []
    for part in (prefix_only(case), draft_only(case)):
        parts += mlagen.verify_attention(part.q, part.kv_cache, part.block_table, part.cache_seqlens,
                                         **part.kwargs(), **kw)
    out, lse = mlagen.merge_states(*parts)
    ref_out, ref_lse = case.reference(torch.float64)
    _close(out, lse, ref_out, ref_lse)
    mlagen.merge_states_(*parts)
    _close(parts[0], parts[1], ref_out, ref_lse)


def _op_case():
    return make_case(batch=2, seqlen_q=5, heads=64, prefixes=[700, 3000], page_size=64, mask="tree",
                     seed=9, per_request_tree=True)


def test_op_under_torch_compile_fullgraph():
    case = _op_case()

    def step(q, kv, bt, lens, tree):
        out, lse = mlagen.verify_attention_op(q, kv, bt, lens, softmax_scale=case.scale, tree_mask=tree,
                                              return_lse=True)
        return out.float() * 2, lse + 1

    args = (case.q, case.kv_cache, case.block_table, case.cache_seqlens, case.tree_mask)
    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True)(*args)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    ref_out, ref_lse = case.reference(torch.float64)
    _close(eager[0] / 2, eager[1] - 1, ref_out, ref_lse)


def test_op_in_cuda_graph_with_named_variant():
    case = _op_case()
    from mlagen.runtime.op import device_info

    variant = mlagen.Variant(head_tile=8, q_tile=5, stages=1, arch=device_info(torch.cuda.current_device())[0])
    args = (case.q, case.kv_cache, case.block_table, case.cache_seqlens)
    kwargs = dict(softmax_scale=case.scale, tree_mask=case.tree_mask, variant=variant.name)
    mlagen.verify_attention_op(*args, **kwargs)          # warm-up: compiles and loads
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mlagen.verify_attention_op(*args, **kwargs)
    case.q.normal_()                    # new inputs in the captured buffers
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, mlagen.verify_attention_op(*args, **kwargs))


@pytest.mark.parametrize("causal", [False, True])
def test_flash_mla_compat(causal):
    case = make_case(batch=4, seqlen_q=2, heads=128, prefixes=[500, 0, 4000, 64], page_size=64,
                     mask="causal" if causal else "none", seed=5, empty=[False, False, False, True])
    k_cache = case.kv_cache.unsqueeze(2)                       # FlashMLA's [blocks, 64, 1, 576]
    metadata, splits = flash_mla.get_mla_metadata(case.cache_seqlens, 2 * 128, 1)
    out, lse = flash_mla.flash_mla_with_kvcache(case.q, k_cache, case.block_table, case.cache_seqlens, 512,
                                                metadata, splits, causal=causal)
    ref_out, ref_lse = dataclasses.replace(case, scale=576 ** -0.5).reference(torch.float64)  # FlashMLA's default
    assert (lse[3] == math.inf).all() and (out[3] == 0).all()   # FlashMLA's empty-row convention
    _close(out, lse.masked_fill(lse == math.inf, -math.inf), ref_out, ref_lse)


# Several KV heads with sinks, for the CUDA graph and torch.compile tests.
_GRAPH_CASE = FlashMLAParams(4, 2, 700, True, True, 16, 2, sink=True, seed=3000)


@pytest.fixture(scope="module")
def flash_mla_kernels():
    """Compiles the kernels the FlashMLA grid's cases dispatch to (one per KV-head group's
    shape) into the disk cache in parallel processes, before the first of those tests: about 90
    kernels, a minute and a half one after another."""
    from mlagen.codegen.precompile import precompile
    from mlagen.runtime.op import device_info, device_name, device_policy, pick_variant

    index = torch.cuda.current_device()
    arch, gpu, dispatch = device_info(index)[0], device_name(index), device_policy(index)
    jobs = set()
    for p in [*FLASH_MLA_GRID, *FLASH_MLA_ZERO_LENGTH, *FLASH_MLA_SINKS, _GRAPH_CASE]:
        _, width = flash_mla_shape(p)
        problem = mlagen.Problem(heads=p.h_q // p.h_kv, dl=512, dr=64, dtype="bf16", page_size=64,
                                 mask="causal" if p.causal else "none", lse=True)
        jobs.add((problem, pick_variant(problem, p.s_q, p.b, width * 64, width * 64, arch, gpu, None,
                                        policy=dispatch)))
    precompile(sorted(jobs, key=str))


def _check_flash_mla(p: FlashMLAParams, out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor,
                     ref_lse: torch.Tensor) -> None:
    """FlashMLA's own checks (elementwise and cosine, lse +inf for a row with no key), then
    mlagen's row by row (`_close`, on mlagen's -inf convention)."""
    B, S, H = p.b, p.s_q, p.h_q
    assert out.shape == (B, S, H, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (B, H, S) and lse.dtype == torch.float32
    problem = flash_mla_mismatch(out, lse, ref_out, ref_lse)
    assert problem is None, f"{p.id}: {problem}"
    _close(out, lse.masked_fill(lse == math.inf, -math.inf), ref_out, ref_lse)


@pytest.mark.parametrize("p", FLASH_MLA_GRID + FLASH_MLA_ZERO_LENGTH, ids=lambda p: p.id)
def test_flash_mla_dense_decoding_grid(flash_mla_kernels, p):
    """A sample of FlashMLA's dense-decoding correctness grid (tests/dropin_cases.py says which
    cases): b 1..64 (128 with empty requests), s_q 1, 2, 4, 20 to 4096 keys fixed or varied per
    request, H_q 1..128 over H_kv 1, 2, 3, 8, causal or not; NaN past every length and in unused
    pages, block-table entries past each request's pages at page 2147480000. Every other case
    takes the older metadata form."""
    case = flash_mla_case(p)
    if p.seed % 2:
        metadata, splits = flash_mla.get_mla_metadata(case.cache_seqlens, p.s_q * p.h_q // p.h_kv, p.h_kv, p.h_q)
    else:
        metadata, splits = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(case.q, case.k_cache, case.block_table, case.cache_seqlens, 512,
                                                metadata, splits, causal=p.causal)
    _check_flash_mla(p, out, lse, *flash_mla_reference(case))


@pytest.mark.parametrize("p", FLASH_MLA_SINKS, ids=lambda p: p.id)
def test_flash_mla_attention_sinks(flash_mla_kernels, p):
    """attn_sink (a third of the heads +inf, a third -inf, the rest near the rows' lse): out
    scaled by exp(lse) / (exp(lse) + exp(sink)) against the fp64 reference, lse unchanged, rows
    without a key 0."""
    case = flash_mla_case(p)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(case.q, case.k_cache, case.block_table, case.cache_seqlens, 512,
                                                meta, causal=p.causal, attn_sink=case.attn_sink)
    ref_out, ref_lse = flash_mla_reference(case)
    assert (out[:, :, torch.isposinf(case.attn_sink)] == 0).all()
    _check_flash_mla(p, out, lse, ref_out, ref_lse)


def test_flash_mla_kv_heads_and_sinks_in_cuda_graph(flash_mla_kernels):
    """Several KV heads and a sink, captured in a CUDA graph (nothing reads back to the host):
    a replay on new q values gives what an eager call gives."""
    case = flash_mla_case(_GRAPH_CASE)
    meta, _ = flash_mla.get_mla_metadata()
    args = (case.k_cache, case.block_table, case.cache_seqlens, 512, meta)
    kwargs = dict(causal=True, attn_sink=case.attn_sink)
    flash_mla.flash_mla_with_kvcache(case.q, *args, **kwargs)        # compiles and loads
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_mla.flash_mla_with_kvcache(case.q, *args, **kwargs)
    case.q.copy_((torch.randn_like(case.q, dtype=torch.float32) / 10).clamp_(-1, 1))
    graph.replay()
    torch.cuda.synchronize()
    eager = flash_mla.flash_mla_with_kvcache(case.q, *args, **kwargs)
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    _check_flash_mla(_GRAPH_CASE, eager[0], eager[1], *flash_mla_reference(case))


def test_flash_mla_kv_heads_and_sinks_under_torch_compile(flash_mla_kernels):
    """The compat call with several KV heads and a sink inside torch.compile(fullgraph=True):
    one graph, and the result within FlashMLA's tolerances."""
    case = flash_mla_case(_GRAPH_CASE)
    meta, _ = flash_mla.get_mla_metadata()

    def step(q, k_cache, block_table, cache_seqlens, sink):
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, meta, causal=True,
                                                attn_sink=sink)

    compiled = torch.compile(step, fullgraph=True)
    out, lse = compiled(case.q, case.k_cache, case.block_table, case.cache_seqlens, case.attn_sink)
    _check_flash_mla(_GRAPH_CASE, out, lse, *flash_mla_reference(case))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build the C++ example")
@pytest.mark.parametrize("part16, tma, seesaw, transposed", [("0", "0", "0", "0"), ("1", "0", "0", "0"),
                                                          ("1", "1", "0", "0"), ("0", "1", "1", "0"),
                                                          ("1", "0", "0", "1")])
def test_cpp_launcher_example_runs(tmp_path, part16, tma, seesaw, transposed):
    """The example's runs: 1, the default and a forced split, each launched twice back to back
    (the second programmatically on sm_90+), with fp32 or 16-bit partial rows; on sm_90, also
    the TMA kernels (with and without the seesaw) on the tensor map the launcher makes, and the
    transposed tile."""
    from mlagen.runtime.op import device_info

    arch = device_info(torch.cuda.current_device())[0]
    if "1" in (tma, transposed):
        if arch != "sm_90":
            pytest.skip(f"TMA kernels and the transposed tile are sm_90a's; this GPU is {arch}")
        arch = "sm_90a"
    build = subprocess.run(["make", "-C", str(ROOT / "examples" / "cpp_launcher"), f"BUILD={tmp_path}",
                            f"PYTHON={sys.executable}", f"ARCH={arch}", f"PART16={part16}", f"TMA={tma}",
                            f"SEESAW={seesaw}", f"TRANSPOSED={transposed}", "run"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "PASS" in build.stdout


# Ragged rows on every balanced schedule: H=16 with 4-position query tiles (3 of them at S=9, so
# requests' real tiles are dealt round 3 slots), and 2-position transposed tiles (5 slots).
RAGGED_VARIANTS = ["mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_rg_sm90a", "mma_ht16_qt4_bn64_w8_st2_spb_rg_sm90a",
                   "mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_rg_sm90a", "mma_ht16_qt2_bn64_w8_st2_spb_p16_tr_rg_sm90a"]


@pytest.mark.parametrize("name", RAGGED_VARIANTS)
@pytest.mark.parametrize("mask", ["causal", "tree"])
@pytest.mark.parametrize("batch", [40, 130])
def test_ragged_rows_match_per_request_reference(name, mask, batch):
    """Draft counts 0..9 (empty requests and requests without a cache among them) through a
    balanced split that runs only the real rows: 40 requests are dealt round the row-group slots,
    130 are more than the lanes hold (no deal; each slot runs every request's row group)."""
    from mlagen.dsl.spec import parse_variant

    gen = torch.Generator().manual_seed(batch)
    counts = torch.randint(0, 10, (batch,), generator=gen).tolist()
    counts[0], counts[1] = 9, 0                       # the widest request and an empty one
    prefixes = torch.randint(0, 3000, (batch,), generator=gen).tolist()
    prefixes[2] = 0
    q, case, cu, tree = ragged_case(counts, prefixes, heads=16, mask=mask, seed=batch, page_size=64,
                                    dtype=torch.bfloat16, device="cuda")
    out, lse = mlagen.verify_attention_varlen(q, case.kv_cache, case.block_table, case.cache_seqlens, cu, 9,
                                              softmax_scale=case.scale, causal=case.causal, tree_mask=tree,
                                              return_lse=True, variant=parse_variant(name))
    ref_out, ref_lse = per_request_reference(q, case, cu, tree)
    _close(out, lse, ref_out, ref_lse)
