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
    assert schema.startswith("mlagen::verify_attention(Tensor q, Tensor kv_cache, Tensor? block_table, "
                             "Tensor? cache_seqlens, float? softmax_scale=None, bool causal=True, "
                             "Tensor? tree_mask=None, bool return_lse=False, str? variant=None")
    assert schema.endswith("Tensor? attn_sink=None, bool? batch_invariant=None, float? kv_scale=None, "
                           "Tensor? kv_scale_tensor=None, float? q_scale=None, Tensor? q_scale_tensor=None, "
                           "Tensor? indices=None, Tensor? topk_length=None, Tensor? extra_kv_cache=None, "
                           "Tensor? extra_indices=None, Tensor? extra_topk_length=None) -> (Tensor, Tensor)")


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


@pytest.mark.parametrize("q_dtype, kv_dtype, row, out_dtype", [
    (torch.bfloat16, torch.float8_e4m3fn, 576, torch.bfloat16),
    (torch.float16, torch.uint8, 656, torch.float16),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, 576, torch.bfloat16),
    (torch.float8_e4m3fn, torch.float16, 576, torch.float16),
])
def test_meta_shapes_of_fp8_calls(q_dtype, kv_dtype, row, out_dtype):
    """The fake implementation gives out in the dtype the op returns: q's, or with e4m3 queries
    a 16-bit cache's (bf16 over an FP8 cache)."""
    q = torch.empty(2, 3, 8, 576, dtype=q_dtype, device="meta")
    kv = torch.empty(10, 64, row, dtype=kv_dtype, device="meta")
    _, _, bt, lens = _inputs("meta")
    out = mlagen.verify_attention_op(q, kv, bt, lens, kv_scale=torch.ones(1, device="meta"), q_scale=0.5)
    assert out.shape == (2, 3, 8, 512) and out.dtype == out_dtype


def test_compile_fullgraph_traces_an_fp8_call():
    """Scales as a tensor and as a float both go through torch.compile(fullgraph=True)."""
    def step(q, kv, bt, lens, scale):
        return mlagen.verify_attention_op(q, kv, bt, lens, kv_scale=scale, q_scale=2.0)

    q = torch.empty(2, 3, 8, 576, dtype=torch.float8_e4m3fn, device="meta")
    kv = torch.empty(10, 64, 576, dtype=torch.float8_e4m3fn, device="meta")
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    out = compiled(q, kv, *_inputs("meta")[2:], torch.ones(1, device="meta"))
    assert out.shape == (2, 3, 8, 512) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["kv_scale", "q_scale"])
@pytest.mark.parametrize("bad", ["0.5", True, [0.5]])
def test_op_names_a_bad_scale_before_the_op_sees_it(name, bad):
    q, kv, bt, lens = _inputs("cpu")
    with pytest.raises(mlagen.InputError, match=f"^{name}: got {type(bad).__name__}, expected None, a float or"):
        mlagen.verify_attention_op(q, kv, bt, lens, **{name: bad})


def test_op_passes_each_scale_to_verify_attention(monkeypatch):
    """A float scale and a tensor scale both reach verify_attention as given."""
    seen = {}

    def fake(q, *args, kv_scale=None, q_scale=None, **kwargs):
        seen.update(kv_scale=kv_scale, q_scale=q_scale)
        return q.new_zeros(*q.shape[:3], 512)

    monkeypatch.setattr(mlagen.runtime.ops, "verify_attention", fake)
    scale = torch.full((1,), 0.25)
    mlagen.verify_attention_op(*_inputs("cpu"), kv_scale=scale, q_scale=3)
    assert seen["kv_scale"] is scale and seen["q_scale"] == 3.0 and isinstance(seen["q_scale"], float)
