"""GPU tests of the drop-in pieces: varlen, merge_states, the custom op under torch.compile and
CUDA graphs, the FlashMLA-compatible API and the C++ launcher example."""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dropin_cases import draft_only, per_request_reference, prefix_only, ragged_case

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
