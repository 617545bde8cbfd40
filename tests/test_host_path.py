"""The op's per-call host path without a GPU: CPU tensors stand in for CUDA ones, and the
GPU-only pieces (the CUDA check, dispatch and loading, torch's CUDA device and stream, the
driver's cuLaunchKernel) are replaced by fakes that record what would reach the driver."""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
import threading
import types

import pytest
import torch

from mlagen.plan.params import FIELD_NAMES, PARAMS_SIZE, POINTER_NAMES, TAIL_NAMES, tail
from mlagen.runtime import inputs, lasting, launch, op, workspace
from mlagen.runtime.inputs import InputError

B, S, H, D, DL, PAGES, PAGE = 2, 3, 4, 576, 512, 5, 16
MAIN = (0x7F00, 8, 2, B + 4, 256, 1, 1, 100_000)    # function, grid (2 splits, merge slabs), block, smem
GROUPS = 8 * B                                        # row groups: grid x * B
_FORMAT = struct.Struct("<16Q13q7iffiq")


class Driver:
    """A fake cuLaunchKernel: records each launch's arguments and its parameter block."""

    def __init__(self, fail: bool = False) -> None:
        self.launches: list[tuple[tuple[int, ...], bytes]] = []
        self.fail = fail

    def __call__(self, *args: int) -> None:
        assert len(args) == 11 and args[-1] == 0          # ..., stream, kernelParams, extra
        block = ctypes.c_void_p.from_address(args[9]).value   # kernelParams[0]
        self.launches.append((args, ctypes.string_at(block, PARAMS_SIZE)))
        if self.fail:
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE: invalid argument")


def fields(block: bytes) -> dict[str, int | float]:
    return dict(zip(FIELD_NAMES, _FORMAT.unpack(block), strict=True))


@pytest.fixture
def fake_gpu(monkeypatch):
    """verify_attention runnable on CPU tensors; returns the fake driver and a list of the
    _prepare calls (one per checked signature)."""
    driver, prepared = Driver(), []
    kernel = launch.KernelLaunch(args=MAIN, name="main_k")

    def prepare(heads, dl, dr, dtype, page_size, mask, lse, batch, seqlen_q, kv_capacity, table_capacity, device,
                variant, invariant=False, kv_format="dtype", q_format="dtype", ragged=False, keys="paged"):
        prepared.append((heads, dl, dr, dtype, page_size, mask, lse, batch, seqlen_q, kv_capacity, device, variant,
                         invariant, kv_format, q_format, ragged, keys))
        rows, value_bytes = 2 * batch * seqlen_q * heads, 2 if variant and variant.partials == "16bit" else 4
        return op._Prepared(loaded=None, kernel=kernel, splits=2, merge_blocks=3,
                                 layout=workspace.Layout.of(rows, dl * value_bytes, GROUPS))

    monkeypatch.setattr(op, "_calls", {})
    monkeypatch.setattr(op, "_require_cuda", lambda q: None)
    monkeypatch.setattr(op, "_prepare", prepare)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0x5EAB, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    monkeypatch.setattr(workspace, "_buffers", {})
    monkeypatch.setattr(workspace, "_arenas", {})
    monkeypatch.setattr(lasting, "make", lambda build, device: build())   # no CUDA streams to run it on
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(launch, "_launch_kernel", lambda: driver)
    return types.SimpleNamespace(driver=driver, prepared=prepared)


def make_args(**change) -> dict:
    a = dict(q=torch.zeros(B, S, H, D, dtype=torch.bfloat16),
             kv_cache=torch.zeros(PAGES, PAGE, D, dtype=torch.bfloat16),
             block_table=torch.zeros(B, 2, dtype=torch.int32),
             cache_seqlens=torch.full((B,), 20, dtype=torch.int32))
    a.update(change)
    return a


def call(a: dict, **kw):
    a = dict(a)
    return op.verify_attention(a.pop("q"), a.pop("kv_cache"), a.pop("block_table"), a.pop("cache_seqlens"),
                                    **a, **kw)


def misaligned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of `shape` one element past a 16-byte boundary (same strides)."""
    n = 1
    for s in shape:
        n *= s
    return torch.zeros(n + 8, dtype=dtype)[1: n + 1].view(shape)


def test_repeat_calls_reuse_one_checked_call(fake_gpu):
    a = make_args()
    out = torch.empty(B, S, H, DL, dtype=torch.bfloat16)
    for _ in range(3):
        assert call(a, out=out) is out
    assert len(fake_gpu.prepared) == 1 and len(op._calls) == 1
    (key, checked), = op._calls.items()
    assert checked.shapes == inputs.check_inputs(a["q"], a["kv_cache"], a["block_table"], a["cache_seqlens"],
                                                 None, DL, None)
    # new tensors with equal metadata hit the same entry
    call(make_args(), out=torch.empty(B, S, H, DL, dtype=torch.bfloat16))
    assert len(fake_gpu.prepared) == 1


def test_a_length_bound_plans_for_itself_not_the_block_tables_capacity(fake_gpu):
    """Engines size block tables for the longest context: max_seqlen_k has the variant and split
    planned for the bound (a quarter octave up), one plan per quarter octave, never past the
    capacity; the kernel still gets the block table's real width."""
    a = make_args(block_table=torch.zeros(B, 400, dtype=torch.int32))     # 400 pages of 16 keys

    def capacity() -> int:                                               # what the last plan got
        return fake_gpu.prepared[-1][9]
    call(a)
    assert capacity() == 400 * PAGE
    call(a, max_seqlen_k=20)
    assert capacity() == 64                                              # one tile at least
    call(a, max_seqlen_k=1000)
    assert capacity() == 1024
    call(a, max_seqlen_k=1010)                                           # the same quarter octave
    call(a, max_seqlen_k=10**6)
    assert capacity() == 400 * PAGE
    assert len(fake_gpu.prepared) == 4
    assert {fields(block)["max_pages"] for _, block in fake_gpu.driver.launches} == {400}
    with pytest.raises(InputError, match="^max_seqlen_k: got -1"):
        call(a, max_seqlen_k=-1)


def test_part16_workspace_holds_16_bit_rows_then_fp32_stats(fake_gpu):
    """A part16 variant's partial rows are Dl 16-bit values: part_ml starts half as far in."""
    from mlagen.dsl.spec import parse_variant

    call(make_args(), variant=parse_variant("mma_ht4_qt1_bn64_w8_st2_spa_p16_sm90a"))
    (_, block), = fake_gpu.driver.launches
    f = fields(block)
    assert f["part_ml"] == f["part_o"] + 2 * B * S * H * DL * 2
    assert workspace._buffers[(0, 0x5EAB)][0].numel() * 4 == 2 * B * S * H * (DL * 2 + 8)


def test_launch_gets_pointers_strides_and_sizes(fake_gpu):
    a = make_args(kv_cache=torch.zeros(PAGES, PAGE, 1, D, dtype=torch.bfloat16))
    tree = torch.ones(B, S, S, dtype=torch.bool)
    out, lse = call(a, tree_mask=tree, return_lse=True, softmax_scale=0.5)
    assert out.shape == (B, S, H, DL) and lse.shape == (B, H, S) and lse.dtype == torch.float32
    (main_args, block), = fake_gpu.driver.launches                  # one launch: merge blocks inside
    assert main_args[:8] == MAIN and main_args[8] == 0x5EAB
    f = fields(block)
    assert (f["q"], f["kv"], f["block_table"], f["seqlens"], f["tree_mask"], f["out"], f["lse"]) == (
        a["q"].data_ptr(), a["kv_cache"].data_ptr(), a["block_table"].data_ptr(), a["cache_seqlens"].data_ptr(),
        tree.data_ptr(), out.data_ptr(), lse.data_ptr())
    assert f["part_o"] != 0 and f["part_ml"] == f["part_o"] + 2 * B * S * H * DL * 4
    counters = workspace._buffers[(0, 0x5EAB)][1]
    assert f["counters"] == counters.data_ptr() and counters.numel() == GROUPS and not counters.any()
    assert (f["q_stride_b"], f["q_stride_s"], f["q_stride_h"]) == a["q"].stride()[:3]
    assert (f["kv_stride_page"], f["kv_stride_row"]) == (PAGE * D, D)
    assert (f["bt_stride_b"], f["mask_stride_b"], f["mask_stride_q"]) == (2, S * S, S)
    assert (f["out_stride_b"], f["out_stride_s"], f["out_stride_h"]) == out.stride()[:3]
    assert (f["batch"], f["seqlen_q"], f["max_pages"], f["num_pages"], f["num_splits"]) == (B, S, 2, PAGES, 2)
    assert (f["merge_blocks"], f["dependent"]) == (3, 0)   # a plain launch
    assert f["scale_log2"] == pytest.approx(0.5 * op.LOG2E)


def test_q_counts_reach_the_plan_and_the_parameter_block(fake_gpu):
    """q_counts (ragged rows) plan the call apart (the dispatcher's balanced split then runs
    ragged rows) and its pointer goes into the block; a call without it passes null."""
    a = make_args()
    call(a)
    assert fields(fake_gpu.driver.launches[-1][1])["q_counts"] == 0 and fake_gpu.prepared[-1][-2] is False
    counts = torch.tensor([3, 1], dtype=torch.int32)
    call(a, q_counts=counts)
    assert fields(fake_gpu.driver.launches[-1][1])["q_counts"] == counts.data_ptr()
    assert fake_gpu.prepared[-1][-2] is True and len(fake_gpu.prepared) == 2


@pytest.mark.parametrize("counts,match", [
    (torch.tensor([3, 1], dtype=torch.int64), r"q_counts: got torch.int64 \(2,\), expected int32 \[B\]=\[2\]"),
    (torch.tensor([3], dtype=torch.int32), r"q_counts: got torch.int32 \(1,\), expected int32 \[B\]=\[2\]"),
    (torch.tensor([3, 4], dtype=torch.int32), r"q_counts\[1\]: got 4, expected 0..S=3"),
    ([3, 1], r"q_counts: got list"),
    (torch.tensor([3, 0, 1, 0], dtype=torch.int32)[::2],
     r"q_counts.stride\(\): got \(2,\), expected \(1,\): contiguous"),
])
def test_bad_q_counts_are_named(fake_gpu, counts, match):
    with pytest.raises(InputError, match=match):
        call(make_args(), q_counts=counts, check_values=True)
    assert not fake_gpu.driver.launches


def test_default_scale_and_pointers_refresh_on_a_hit(fake_gpu):
    call(make_args())
    a = make_args()
    out = call(a)
    f = fields(fake_gpu.driver.launches[-1][1])
    assert (f["q"], f["out"], f["lse"], f["tree_mask"]) == (a["q"].data_ptr(), out.data_ptr(), 0, 0)
    assert f["scale_log2"] == pytest.approx(op.LOG2E / D ** 0.5)
    assert len(fake_gpu.prepared) == 1


@pytest.mark.parametrize("change", [
    dict(q=torch.zeros(B, S, H, D, dtype=torch.float16), kv_cache=torch.zeros(PAGES, PAGE, D, dtype=torch.float16)),
    dict(q=torch.zeros(B, S + 1, H, D, dtype=torch.bfloat16)),
    dict(q=torch.zeros(B, H, S, D, dtype=torch.bfloat16).transpose(1, 2)),              # strides only
    dict(kv_cache=torch.zeros(PAGES + 1, PAGE, D, dtype=torch.bfloat16)),
    dict(kv_cache=torch.zeros(PAGES, PAGE, 1, D, dtype=torch.bfloat16)),
    dict(block_table=torch.zeros(B, 3, dtype=torch.int32)),
    dict(block_table=torch.zeros(B, 4, dtype=torch.int32)[:, :2]),                      # strides only
    dict(tree_mask=torch.ones(S, S, dtype=torch.bool)),
    dict(out=torch.empty(B, S, H, DL, dtype=torch.bfloat16)),
    dict(out=torch.empty(B, S, H, DL + 8, dtype=torch.bfloat16)[..., :DL]),
    dict(head_dim_v=256),
    dict(softmax_scale=0.25),
    dict(causal=False),
    dict(return_lse=True),
    dict(q=torch.nn.Parameter(torch.zeros(B, S, H, D, dtype=torch.bfloat16), requires_grad=False)),  # type
])
def test_any_metadata_change_checks_again(fake_gpu, change):
    call(make_args())
    a = make_args()
    a.update(change)
    call(a)
    assert len(fake_gpu.prepared) == 2 and len(op._calls) == 2


@pytest.mark.parametrize("change,match", [
    (dict(q=misaligned((B, S, H, D), torch.bfloat16)), r"q.data_ptr\(\): got 0x[0-9a-f]+, expected a 16-byte"),
    (dict(kv_cache=misaligned((PAGES, PAGE, D), torch.bfloat16)), r"kv_cache.data_ptr\(\)"),
    (dict(out=misaligned((B, S, H, DL), torch.bfloat16)), r"out.data_ptr\(\)"),
    (dict(block_table=[[0, 1], [2, 3]]), r"block_table: got list, expected a torch.Tensor"),
    (dict(cache_seqlens=torch.zeros(B, 2, dtype=torch.int32)[:, 0]), r"cache_seqlens.shape: .*a contiguous"),
    (dict(cache_seqlens=torch.full((B,), 99, dtype=torch.int32), check_values=True), r"cache_seqlens\[0\]: got 99"),
    (dict(block_table=torch.full((B, 2), 7, dtype=torch.int32), check_values=True), r"block_table: got page id 7"),
    (dict(softmax_scale=[1.0]), r"softmax_scale: got \[1.0\]"),
])
def test_errors_still_raised_after_a_cached_call(fake_gpu, change, match):
    good_out = torch.empty(B, S, H, DL, dtype=torch.bfloat16)
    call(make_args(), out=good_out)
    a = make_args(out=good_out)
    a.update(change)
    launches = len(fake_gpu.driver.launches)
    with pytest.raises(InputError, match=match):
        call(a)
    assert len(fake_gpu.driver.launches) == launches      # nothing launched


def test_a_scale_tensors_value_is_checked_on_every_checked_call(fake_gpu):
    """check_values reads a kv_scale tensor back on a remembered call too: its value may change
    between calls that share one checked call."""
    e4m3 = make_args(kv_cache=torch.zeros(PAGES, PAGE, D, dtype=torch.float8_e4m3fn))
    call(e4m3, kv_scale=torch.ones(1), check_values=True)
    launches = len(fake_gpu.driver.launches)
    with pytest.raises(InputError, match="^kv_scale: got nan, expected a finite scale > 0"):
        call(e4m3, kv_scale=torch.full((1,), float("nan")), check_values=True)
    assert len(fake_gpu.driver.launches) == launches and len(op._calls) == 1
    call(e4m3, kv_scale=torch.full((1,), float("nan")))        # unchecked: a device value is not read


def test_check_values_default_comes_from_the_module_flag(fake_gpu, monkeypatch):
    bad = make_args(cache_seqlens=torch.full((B,), 99, dtype=torch.int32))
    call(bad)                                             # unchecked by default
    monkeypatch.setattr(inputs, "CHECK_VALUES_DEFAULT", True)
    with pytest.raises(InputError, match=r"cache_seqlens\[0\]"):
        call(bad)
    call(bad, check_values=False)


def test_signature_cache_is_bounded(fake_gpu, monkeypatch):
    monkeypatch.setattr(op, "_MAX_CALLS", 3)
    for scale in (0.1, 0.2, 0.3, 0.4):
        call(make_args(), softmax_scale=scale)
    assert len(op._calls) == 1                        # started over at the bound


def _last(driver: Driver) -> tuple[int, int]:
    f = fields(driver.launches[-1][1])
    return f["part_o"], f["counters"]


def test_workspace_reused_per_stream_and_fresh_under_capture(fake_gpu, monkeypatch):
    a, driver = make_args(), fake_gpu.driver
    call(a)
    first = _last(driver)
    call(a)
    assert _last(driver) == first and 0 not in first          # eager, same stream: one buffer
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0x0777, raising=False)
    call(a)
    other = _last(driver)
    assert not set(other) & set(first)                        # another stream: its own buffers
    assert set(workspace._buffers) == {(0, 0x5EAB), (0, 0x0777)}
    # A larger shape on the same stream replaces the partials with a big enough buffer and
    # keeps the (zero) counters, which are large enough.
    call(make_args(q=torch.zeros(B, S + 2, H, D, dtype=torch.bfloat16)))
    partials, counters = workspace._buffers[(0, 0x0777)][:2]
    assert partials.numel() == 2 * B * (S + 2) * H * (DL + 2) and _last(driver)[1] == other[1]
    # Under capture: partials from the allocator, counters handed out once from the arena.
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True, raising=False)
    (arena,) = workspace._arenas[0]
    used = arena.used
    eager = {t.data_ptr() for bufs in workspace._buffers.values() for t in bufs[:2]}
    call(a)
    c1 = _last(driver)
    call(a)
    c2 = _last(driver)
    assert not eager & {c1[0], c1[1], c2[0], c2[1]}
    assert c2[1] == c1[1] + 4 * GROUPS and arena.used == used + 2 * GROUPS
    assert c1[1] == arena.counters.data_ptr() + 4 * used
    # An exhausted arena: the capture zeroes counters of its own.
    arena.used = workspace.ARENA_COUNTERS
    call(a)
    assert not arena.counters.data_ptr() <= _last(driver)[1] < arena.counters.data_ptr() + 4 * arena.used
    workspace.release()
    assert workspace._buffers == {}


def test_workspace_buffers_are_bounded_per_stream(fake_gpu, monkeypatch):
    a = make_args()
    for stream in range(1, workspace._MAX_STREAMS + 2):
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device, s=stream: s, raising=False)
        call(a)
        assert (0, stream) in workspace._buffers and len(workspace._buffers) <= workspace._MAX_STREAMS
    assert len(workspace._arenas[0]) == 1          # one arena serves every stream's captures


def test_empty_batch_launches_nothing(fake_gpu):
    out = call(make_args(q=torch.zeros(0, S, H, D, dtype=torch.bfloat16),
                         block_table=torch.zeros(0, 2, dtype=torch.int32),
                         cache_seqlens=torch.zeros(0, dtype=torch.int32)))
    assert out.shape == (0, S, H, DL) and not fake_gpu.driver.launches


def _loaded(capability: int) -> types.SimpleNamespace:
    plan = types.SimpleNamespace(launch_threads=256, smem_bytes=100_000, main_kernel="main_k",
                                 arch=types.SimpleNamespace(capability=capability))
    return types.SimpleNamespace(plan=plan, main=types.SimpleNamespace(ptr=0x7F00))


def test_kernel_launch_holds_the_launch_arguments(monkeypatch):
    monkeypatch.setattr(launch, "PDL", False)                      # the default (MLAGEN_PDL unset)
    k = launch.kernel_launch(_loaded(90), (8, 2, B + 4))
    assert (k.args, k.name, k.pdl) == (MAIN, "main_k", False)
    monkeypatch.setattr(launch, "PDL", True)                       # MLAGEN_PDL=1
    assert launch.kernel_launch(_loaded(90), (8, 2, B + 4)).pdl
    assert not launch.kernel_launch(_loaded(80), (8, 2, B + 4)).pdl   # no griddepcontrol before sm_90
    monkeypatch.setattr(launch, "PDL", False)
    assert launch.kernel_launch(_loaded(90), (8, 2, B + 4), in_graphs=True).pdl_captured
    assert not launch.kernel_launch(_loaded(90), (8, 2, B + 4)).pdl_captured
    assert not launch.kernel_launch(_loaded(80), (8, 2, B + 4), in_graphs=True).pdl_captured
    monkeypatch.setattr(launch, "PDL_NEVER", True)                 # MLAGEN_PDL=0
    assert not launch.kernel_launch(_loaded(90), (8, 2, B + 4), in_graphs=True).pdl_captured


def test_short_launches_are_dependent_only_under_capture(monkeypatch):
    """A short launch (`pdl_captured`) goes through cuLaunchKernelEx with the PDL attribute while
    its stream is captured (no host cost counts in a graph) and through plain cuLaunchKernel
    otherwise."""
    ex, plain = DriverEx(), Driver()
    monkeypatch.setattr(launch, "_launch_kernel_ex", lambda: ex)
    monkeypatch.setattr(launch, "_launch_kernel", lambda: plain)
    capturing = {0x5EAB: True, 0x1234: False}
    monkeypatch.setattr(launch, "_capturing", lambda stream: capturing[stream])
    kernel = launch.KernelLaunch(args=MAIN, name="main_k", pdl_captured=True)
    rest = tail(dict.fromkeys(TAIL_NAMES, 1) | {"dependent": 0})
    launch.launch(kernel, 0x5EAB, (16,) + (0,) * (len(POINTER_NAMES) - 1), rest)
    launch.launch(kernel, 0x1234, (32,) + (0,) * (len(POINTER_NAMES) - 1), rest)
    assert [d["stream"] for d in ex.launches] == [0x5EAB] and ex.launches[0]["attrs"] == [(6, 1)]
    assert len(plain.launches) == 1
    # The kernel learns which it was: its speculative prefetches only pay as a dependent.
    assert fields(ex.launches[0]["params"])["dependent"] == 1 and fields(plain.launches[0][1])["dependent"] == 0
    assert fields(ex.launches[0]["params"])["q"] == 16 and fields(plain.launches[0][1])["q"] == 32


class DriverEx:
    """A fake cuLaunchKernelEx: records the launch config's fields and the parameter block."""

    def __init__(self, code: int = 0) -> None:
        self.code, self.launches = code, []

    def __call__(self, config_address, function, params, extra) -> int:
        config = launch.LaunchConfig.from_address(config_address)
        attr = config.attrs[0]
        block = ctypes.c_void_p.from_address(params).value
        self.launches.append(dict(grid=tuple(config.grid), block=tuple(config.block), shared=config.shared_bytes,
                                  stream=config.stream, attrs=[(attr.id, attr.value[0])] * config.num_attrs,
                                  function=function, extra=extra, params=ctypes.string_at(block, PARAMS_SIZE)))
        return self.code


def test_dependent_launch_fills_the_launch_config(monkeypatch):
    """sm_90+ kernels go through cuLaunchKernelEx with the programmatic-stream-serialization
    attribute (id 6, allowed = 1), the shape's grid, block and shared memory, and the stream."""
    driver = DriverEx()
    monkeypatch.setattr(launch, "_launch_kernel_ex", lambda: driver)
    kernel = launch.KernelLaunch(args=MAIN, name="main_k", pdl=True)
    rest = tail(dict.fromkeys(TAIL_NAMES, 1))
    launch.launch(kernel, 0x5EAB, (16,) + (0,) * (len(POINTER_NAMES) - 1), rest)
    launch.launch(kernel, 0, (32,) + (0,) * (len(POINTER_NAMES) - 1), rest)
    first, second = driver.launches
    assert first["grid"] == MAIN[1:4] and first["block"] == MAIN[4:7] and first["shared"] == MAIN[7]
    assert first["function"] == MAIN[0] and first["extra"] is None and first["attrs"] == [(6, 1)]
    assert first["stream"] == 0x5EAB and not second["stream"]
    assert fields(first["params"])["q"] == 16 and fields(second["params"])["q"] == 32


def test_dependent_launch_errors_name_the_kernel(monkeypatch):
    monkeypatch.setattr(launch, "_launch_kernel_ex", lambda: DriverEx(code=1))
    monkeypatch.setattr(launch, "_error_name", lambda code: "CUDA_ERROR_INVALID_VALUE" if code == 1 else "?")
    kernel = launch.KernelLaunch(args=MAIN, name="main_k", pdl=True)
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx of main_k failed: CUDA_ERROR_INVALID_VALUE"):
        launch.launch(kernel, 0, (0,) * len(POINTER_NAMES), tail(dict.fromkeys(TAIL_NAMES, 0)))


LAYOUT_PROGRAM = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream),
         offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttribute),
         offsetof(CUlaunchAttribute, value), offsetof(CUlaunchConfig, sharedMemBytes),
         (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
  return 0;
}
"""


def test_launch_config_matches_cuda_h(tmp_path):
    """The ctypes structs cuLaunchKernelEx reads, against cuda.h's own layout (a C compiler and
    the CUDA headers of the nvidia wheels or a toolkit)."""
    from mlagen.codegen.compiler import cuda_include_dir

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to read cuda.h's layout")
    include = cuda_include_dir()
    if not os.path.exists(os.path.join(include, "cuda.h")):
        pytest.skip(f"no cuda.h under {include}")
    (tmp_path / "layout.c").write_text(LAYOUT_PROGRAM)
    subprocess.run([cc, f"-I{include}", "-o", str(tmp_path / "layout"), str(tmp_path / "layout.c")], check=True)
    got = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split()
    C, A = launch.LaunchConfig, launch.LaunchAttribute
    assert list(map(int, got)) == [ctypes.sizeof(C), C.stream.offset, C.attrs.offset, C.num_attrs.offset,
                                   ctypes.sizeof(A), A.value.offset, C.shared_bytes.offset,
                                   launch._PROGRAMMATIC_STREAM_SERIALIZATION]


def test_launch_errors_name_the_kernel(monkeypatch):
    monkeypatch.setattr(launch, "_launch_kernel", lambda: Driver(fail=True))
    kernel = launch.KernelLaunch(args=MAIN, name="main_k")
    rest = tail(dict.fromkeys(TAIL_NAMES, 0))
    with pytest.raises(RuntimeError, match="cuLaunchKernel of main_k failed: CUDA_ERROR_INVALID_VALUE"):
        launch.launch(kernel, 0, (0,) * len(POINTER_NAMES), rest)


def test_parameter_blocks_are_per_thread(monkeypatch):
    driver = Driver()
    monkeypatch.setattr(launch, "_launch_kernel", lambda: driver)
    kernel = launch.KernelLaunch(args=MAIN, name="main_k")
    rest = tail(dict.fromkeys(TAIL_NAMES, 1))

    def run(first_pointer: int) -> None:
        launch.launch(kernel, 0, (first_pointer,) + (0,) * (len(POINTER_NAMES) - 1), rest)

    run(16)
    worker = threading.Thread(target=run, args=(32,))
    worker.start()
    worker.join()
    (main_args, block), (thread_args, thread_block) = driver.launches
    assert main_args[9] != thread_args[9]
    assert fields(block)["q"] == 16 and fields(thread_block)["q"] == 32


def test_tail_names_missing_fields():
    with pytest.raises(KeyError, match="missing"):
        tail({"batch": 1})


def test_batch_invariant_calls_plan_apart_and_follow_the_environment(fake_gpu, monkeypatch):
    """batch_invariant=True reaches the plan and keys a call of its own; None takes
    MLAGEN_BATCH_INVARIANT's default; a named variant still reaches the plan as given."""
    a = make_args()
    call(a)
    call(a, batch_invariant=True)
    call(a, batch_invariant=True)
    assert [p[-5] for p in fake_gpu.prepared] == [False, True] and len(op._calls) == 2
    monkeypatch.setattr(op, "BATCH_INVARIANT_DEFAULT", True)
    call(a)                                                            # the same call as batch_invariant=True
    assert len(fake_gpu.prepared) == 2
    call(a, batch_invariant=False)
    assert len(fake_gpu.prepared) == 2 and len(op._calls) == 2          # the same call as the first


def test_fp8_caches_reach_the_plan_with_their_scale(fake_gpu):
    """An e4m3 cache plans as kv_format "e4m3" and launches with its kv_scale: a float in the
    parameter block (a new value, a new checked call), a tensor through kv_scale_ptr, read at
    each launch; a ds_mla cache plans as "ds_mla" and takes no kv_scale."""
    e4m3 = make_args(kv_cache=torch.zeros(PAGES, PAGE, D, dtype=torch.float8_e4m3fn))
    call(e4m3, kv_scale=0.5)
    assert fake_gpu.prepared[-1][-4:-2] == ("e4m3", "dtype")
    block = fields(fake_gpu.driver.launches[-1][1])
    assert block["kv_scale"] == 0.5 and block["kv_scale_ptr"] == 0
    call(e4m3, kv_scale=0.25)
    assert fields(fake_gpu.driver.launches[-1][1])["kv_scale"] == 0.25 and len(op._calls) == 2
    scale = torch.ones(1, dtype=torch.float32)
    call(e4m3, kv_scale=scale)
    assert fields(fake_gpu.driver.launches[-1][1])["kv_scale_ptr"] == scale.data_ptr()
    other = torch.ones(1, dtype=torch.float32)
    call(e4m3, kv_scale=other)                                           # the same call, its own pointer
    assert fields(fake_gpu.driver.launches[-1][1])["kv_scale_ptr"] == other.data_ptr() and len(op._calls) == 3
    ds = make_args(kv_cache=torch.zeros(PAGES, PAGE, 1, 656, dtype=torch.uint8))
    call(ds)
    assert fake_gpu.prepared[-1][-4:-2] == ("ds_mla", "dtype")
    assert fields(fake_gpu.driver.launches[-1][1])["kv_stride_row"] == 656


@pytest.mark.parametrize("cache, kw, message", [
    ((D, torch.float8_e4m3fn), {}, "^kv_scale: got None, expected a float or a one-element torch.float32"),
    ((D, torch.float8_e4m3fn), {"kv_scale": float("nan")}, "^kv_scale: got nan, expected a finite scale > 0"),
    ((D, torch.float8_e4m3fn), {"kv_scale": torch.ones(2)}, "^kv_scale: got a torch.float32 tensor of shape"),
    ((656, torch.uint8), {"kv_scale": 1.0}, "^kv_scale: got float, expected None \\(only an e4m3 cache"),
    ((D, torch.bfloat16), {"kv_scale": 1.0}, "^kv_scale: got float, expected None for a bf16 cache"),
    ((D, torch.uint8), {}, r"^kv_cache.shape\[-1\]: got 576, expected 656 \(a ds_mla row\)"),
    ((656, torch.float8_e4m3fn), {"kv_scale": 1.0}, r"^kv_cache.shape\[-1\]: got 656, expected 576 \(a e4m3 row\)"),
    ((D, torch.float32), {}, "^kv_cache.dtype: got torch.float32, expected q's dtype torch.bfloat16, "
                             "torch.float8_e4m3fn"),
])
def test_fp8_cache_misuse_is_named(fake_gpu, cache, kw, message):
    row, dtype = cache
    with pytest.raises(InputError, match=message):
        call(make_args(kv_cache=torch.zeros(PAGES, PAGE, row, dtype=dtype)), **kw)
    assert not fake_gpu.driver.launches


def test_fp8_caches_hold_deepseeks_rows(fake_gpu):
    """An FP8 cache needs q's 576 dims and a 512-wide value, and 16-byte row strides."""
    q = torch.zeros(B, S, H, 320, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"^q.shape\[-1\] and head_dim_v: got \(320, 256\), expected \(576, 512\)"):
        call(make_args(q=q, kv_cache=torch.zeros(PAGES, PAGE, 320, dtype=torch.float8_e4m3fn)), kv_scale=1.0,
             head_dim_v=256)
    padded = torch.zeros(PAGES, PAGE, 664, dtype=torch.uint8)[:, :, :656]     # rows 664 bytes apart: not 16 x k
    with pytest.raises(InputError, match="multiples of 16 elements"):
        call(make_args(kv_cache=padded))


def test_e4m3_queries_plan_with_their_scale_and_the_caches_output_dtype(fake_gpu):
    """float8_e4m3fn queries: q_format "e4m3", out in the 16-bit cache's dtype (bf16 over an FP8
    cache); a float q_scale folds into scale_log2 (a new value, a new checked call), a tensor
    goes in by pointer; misuse is named."""
    import math as _math

    q8 = torch.zeros(B, S, H, D, dtype=torch.float8_e4m3fn)
    out = call(make_args(q=q8, kv_cache=torch.zeros(PAGES, PAGE, D, dtype=torch.float16)), q_scale=0.5,
               softmax_scale=0.1)
    assert out.dtype == torch.float16 and fake_gpu.prepared[-1][3] == "fp16" and fake_gpu.prepared[-1][-3] == "e4m3"
    block = fields(fake_gpu.driver.launches[-1][1])
    assert _math.isclose(block["scale_log2"], 0.1 * 0.5 * op.LOG2E, rel_tol=1e-6) and block["q_scale_ptr"] == 0
    scale = torch.ones(1, dtype=torch.float32)
    out = call(make_args(q=q8, kv_cache=torch.zeros(PAGES, PAGE, 656, dtype=torch.uint8)), q_scale=scale)
    assert out.dtype == torch.bfloat16 and fake_gpu.prepared[-1][-4:-2] == ("ds_mla", "e4m3")
    assert fields(fake_gpu.driver.launches[-1][1])["q_scale_ptr"] == scale.data_ptr()
    with pytest.raises(InputError, match="^q_scale: got None, expected a float or a one-element"):
        call(make_args(q=q8))
    with pytest.raises(InputError, match="^q_scale: got float, expected None for torch.bfloat16 queries"):
        call(make_args(), q_scale=1.0)
    with pytest.raises(InputError, match=r"^out.dtype: got torch.float16, expected torch.bfloat16 \(the output"):
        call(make_args(q=q8), q_scale=1.0, out=torch.empty(B, S, H, DL, dtype=torch.float16))
    with pytest.raises(InputError, match="^q.dtype: got torch.float32, expected torch.bfloat16, torch.float16 or"):
        call(make_args(q=torch.zeros(B, S, H, D)))


# ---- gathered keys (sparse verify)

def sparse_args(**change) -> dict:
    a = dict(q=torch.zeros(B, S, H, D, dtype=torch.bfloat16),
             kv_cache=torch.zeros(PAGES, PAGE, D, dtype=torch.bfloat16),
             indices=torch.zeros(B, S, 40, dtype=torch.int32), topk_length=torch.full((B,), 40, dtype=torch.int32))
    a.update(change)
    return a


def sparse_call(a: dict, **kw):
    a = dict(a)
    return op.verify_attention(a.pop("q"), a.pop("kv_cache"), **a, **({"causal": False} | kw))


def test_gathered_keys_plan_their_own_call_and_fill_the_block(fake_gpu):
    """A call with indices plans a "gathered" problem with no mask for its topk slots, remembers
    its signature, and passes indices, topk_length, their strides and topk in the parameter
    block with no block table; without topk_length the pointer is null and the call plans apart."""
    a = sparse_args()
    sparse_call(a)
    sparse_call(a)
    assert len(fake_gpu.prepared) == 1 and fake_gpu.prepared[0][-1] == "gathered"
    assert fake_gpu.prepared[0][5] == "none" and fake_gpu.prepared[0][9] == 40
    block = fields(fake_gpu.driver.launches[-1][1])
    assert block["indices"] == a["indices"].data_ptr() and block["topk_length"] == a["topk_length"].data_ptr()
    assert (block["idx_stride_b"], block["idx_stride_s"], block["topk"]) == (S * 40, 40, 40)
    assert block["block_table"] == block["seqlens"] == block["max_pages"] == block["bt_stride_b"] == 0
    sparse_call(sparse_args(topk_length=None))
    assert len(fake_gpu.prepared) == 2 and fields(fake_gpu.driver.launches[-1][1])["topk_length"] == 0


def test_paged_calls_pass_no_gathered_keys(fake_gpu):
    call(make_args())
    block = fields(fake_gpu.driver.launches[-1][1])
    assert fake_gpu.prepared[-1][-1] == "paged"
    assert block["indices"] == block["topk_length"] == block["topk"] == block["idx_stride_b"] == 0


@pytest.mark.parametrize("change,kw,match", [
    ({}, {"causal": True}, r"causal: got True \(the default\), expected causal=False with indices"),
    ({}, {"block_table": torch.zeros(B, 2, dtype=torch.int32)}, r"block_table: got Tensor, expected None with indices"),
    ({}, {"cache_seqlens": torch.zeros(B, dtype=torch.int32)}, r"cache_seqlens: got Tensor, expected None"),
    ({}, {"tree_mask": torch.ones(S, S, dtype=torch.bool)}, r"tree_mask: got Tensor, expected None with indices"),
    ({}, {"q_counts": torch.ones(B, dtype=torch.int32)}, r"q_counts: got Tensor, expected None with indices"),
    ({}, {"max_seqlen_k": 64}, r"max_seqlen_k: got int, expected None with indices"),
    ({"indices": torch.zeros(B, S, 40, dtype=torch.int64)},
     {}, r"indices.dtype: got torch.int64, expected torch\.int32"),
    ({"indices": torch.zeros(B, S + 1, 40, dtype=torch.int32)}, {}, rf"indices.shape: got \({B}, {S + 1}, 40\), "
     rf"expected \[B={B}, S={S}, topk >= 1\]"),
    ({"indices": torch.zeros(B, S, 0, dtype=torch.int32)}, {}, r"indices.shape: got .*topk >= 1"),
    ({"indices": torch.zeros(B, S, 80, dtype=torch.int32)[:, :, ::2]}, {}, r"indices.stride\(\): got .*last dim"),
    ({"topk_length": torch.zeros(B + 1, dtype=torch.int32)}, {}, rf"topk_length.shape: got \({B + 1},\), "
     rf"expected a contiguous \[B={B}\]"),
    ({"topk_length": torch.zeros(B, dtype=torch.int64)}, {}, r"topk_length.dtype: got torch.int64"),
    ({"indices": torch.full((B, S, 40), PAGES * PAGE, dtype=torch.int32)}, {"check_values": True},
     rf"indices: got a row id {PAGES * PAGE}, expected -1 or a row of the cache, 0..{PAGES * PAGE - 1}"),
    ({"indices": torch.full((B, S, 40), -2, dtype=torch.int32)}, {"check_values": True}, r"indices: got a row id -2"),
    ({"topk_length": torch.full((B,), 41, dtype=torch.int32)}, {"check_values": True},
     r"topk_length: got a length 41, expected 0..topk=40"),
])
def test_bad_gathered_keys_are_named_before_any_launch(fake_gpu, change, kw, match):
    with pytest.raises(InputError, match=match):
        sparse_call(sparse_args(**change), **kw)
    assert not fake_gpu.driver.launches


def test_gathered_values_are_checked_on_every_call_when_asked(fake_gpu):
    """check_values reads the row ids back on a remembered call too: values change between calls."""
    a = sparse_args()
    sparse_call(a, check_values=True)
    a["indices"].fill_(PAGES * PAGE)
    with pytest.raises(InputError, match="indices: got a row id"):
        sparse_call(a, check_values=True)
    assert len(fake_gpu.driver.launches) == 1


@pytest.mark.parametrize("name", ["block_table", "cache_seqlens"])
def test_paged_keys_without_their_tables_are_named(fake_gpu, name):
    """Without indices the keys are paged: a missing block_table or cache_seqlens is named."""
    with pytest.raises(InputError, match=rf"^{name}: got NoneType, expected a torch.Tensor"):
        call(make_args(**{name: None}))
    assert not fake_gpu.driver.launches
