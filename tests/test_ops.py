"""The mlagen::verify_attention custom op on CPU: schema, fake (meta) implementation, tracing
by torch.compile without graph breaks. Running it needs a GPU (tests/test_gpu_dropin.py)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mlagen
from mlagen.dsl.spec import naive


def _inputs(device, B=2, S=3, H=8, dtype=torch.bfloat16):
    q = torch.empty(B, S, H, 576, dtype=dtype, device=device)
    kv = torch.empty(10, 64, 1, 576, dtype=dtype, device=device)
    bt = torch.empty(B, 4, dtype=torch.int32, device=device)
    lens = torch.empty(B, dtype=torch.int32, device=device)
    return q, kv, bt, lens


def test_schema():
    schema = str(torch.ops.mlagen.verify_attention.default._schema)
    assert schema.startswith("mlagen::verify_attention(Tensor q, Tensor kv_cache, Tensor block_table, "
                             "Tensor cache_seqlens, float? softmax_scale=None, bool causal=True, "
                             "Tensor? tree_mask=None, bool return_lse=False, str? variant=None")
    assert schema.endswith("Tensor? attn_sink=None, bool? batch_invariant=None) -> (Tensor, Tensor)")


@pytest.mark.parametrize("return_lse", [False, True])
def test_meta_shapes(return_lse):
    q, kv, bt, lens = _inputs("meta", dtype=torch.float16)
    res = mlagen.verify_attention_op(q, kv, bt, lens, return_lse=return_lse, head_dim_v=512)
    out = res[0] if return_lse else res
    assert out.shape == (2, 3, 8, 512) and out.dtype == torch.float16 and out.device.type == "meta"
    if return_lse:
        assert res[1].shape == (2, 8, 3) and res[1].dtype == torch.float32


def test_fake_cuda_tensors():
    with FakeTensorMode():
        q, kv, bt, lens = _inputs("cuda")
        tree = torch.ones(3, 3, dtype=torch.bool, device="cuda")
        out, lse = mlagen.verify_attention_op(q, kv, bt, lens, tree_mask=tree, return_lse=True,
                                              variant=naive(arch="sm_90"))
        assert out.device.type == "cuda" and out.shape == (2, 3, 8, 512) and out.dtype == torch.bfloat16
        assert lse.device.type == "cuda" and lse.shape == (2, 8, 3)


def test_compile_fullgraph_traces_the_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(q, kv, bt, lens):
        out, lse = mlagen.verify_attention_op(q, kv, bt, lens, causal=True, return_lse=True,
                                              variant="flash_ht8_qt4_bn32_w8_st2_spa_sm90")
        return out * 2, lse.exp()

    out, lse = torch.compile(step, backend=backend, fullgraph=True)(*_inputs("meta"))
    assert out.shape == (2, 3, 8, 512) and lse.shape == (2, 8, 3)
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "mlagen" in str(n.target)]
    assert len(calls) == 1 and "verify_attention" in str(calls[0].target)


@pytest.mark.parametrize("bad", [-1, "4096", 4096.0, True])
def test_op_names_a_bad_max_seqlen_k_before_the_op_sees_it(bad):
    # The op's schema would turn True into 1 and refuse a str or float with torch's own error.
    q = torch.zeros(1, 2, 8, 576, dtype=torch.bfloat16)
    with pytest.raises(mlagen.InputError, match=f"^max_seqlen_k: got {bad!r}, expected None or an int >= 0"):
        mlagen.verify_attention_op(q, torch.zeros(4, 64, 576, dtype=torch.bfloat16),
                                   torch.zeros(1, 4, dtype=torch.int32), torch.full((1,), 10, dtype=torch.int32),
                                   max_seqlen_k=bad)


def test_meta_shapes_with_sinks():
    q, kv, bt, lens = _inputs("meta")
    out, lse = mlagen.verify_attention_op(q, kv, bt, lens, return_lse=True, attn_sink=torch.zeros(8, device="meta"))
    assert out.shape == (2, 3, 8, 512) and lse.shape == (2, 8, 3)


@pytest.mark.parametrize("sink, message", [
    (torch.zeros(8, dtype=torch.float64), r"^attn_sink.dtype: got torch.float64, expected torch.float32"),
    (torch.zeros(7), r"^attn_sink.shape: got \(7,\), expected \(8,\): one sink per query head"),
    (torch.zeros(8, device="meta"), r"^attn_sink.device: got meta, expected cpu, where q is"),
    ([0.0] * 8, r"^attn_sink: got list, expected None or a torch.Tensor \[8\] float32"),
])
def test_bad_sinks_are_named_before_anything_runs(sink, message):
    q, kv, bt, lens = _inputs("cpu")
    with pytest.raises(mlagen.InputError, match=message):
        mlagen.verify_attention(q, kv, bt, lens, attn_sink=sink)
