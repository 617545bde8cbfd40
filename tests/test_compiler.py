"""The NVRTC compiler and its disk cache."""

import multiprocessing as mp
import os

import pytest

from mlagen.codegen import compiler
from mlagen.codegen.build import build
from mlagen.dsl.spec import Problem, naive

SOURCE = r"""
#include <cuda_bf16.h>
extern "C" __global__ void k(__nv_bfloat16* x, float v) { x[threadIdx.x] = __float2bfloat16(v); }
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_second_compile_is_a_cache_hit(cache):
    a = compiler.compile_source(SOURCE, "k", "sm_90")
    b = compiler.compile_source(SOURCE, "k", "sm_90")
    assert not a.cached and b.cached and a.cubin == b.cubin and a.key == b.key
    assert a.resources["k"].registers > 0
    c = compiler.compile_source(SOURCE, "k", "sm_80")
    assert c.key != a.key and not c.cached


def test_source_change_misses(cache):
    a = compiler.compile_source(SOURCE, "k", "sm_90")
    b = compiler.compile_source(SOURCE + "\n// edited\n", "k", "sm_90")
    assert a.key != b.key and not b.cached


def test_corrupt_entry_is_rebuilt(cache):
    a = compiler.compile_source(SOURCE, "k", "sm_90")
    cubin = next(cache.rglob(f"{a.key}.cubin"))
    cubin.write_bytes(b"garbage")
    b = compiler.compile_source(SOURCE, "k", "sm_90")
    assert not b.cached and b.cubin == a.cubin
    assert cubin.read_bytes() == a.cubin


def test_compile_error_shows_log_and_source_path(cache):
    with pytest.raises(compiler.CompileError) as info:
        compiler.compile_source("extern \"C\" __global__ void k() { undefined_thing(); }", "bad", "sm_90")
    msg = str(info.value)
    assert "undefined_thing" in msg and "source: " in msg
    path = msg.split("source: ", 1)[1].split("\n", 1)[0]
    assert os.path.isfile(path) and "undefined_thing" in open(path).read()


def _compile_in_child(cache_dir: str, q) -> None:
    os.environ["MLAGEN_CACHE_DIR"] = cache_dir
    m = compiler.compile_source(SOURCE + "// concurrent\n", "k", "sm_90")
    q.put((m.key, len(m.cubin)))


def test_two_processes_compiling_the_same_source(cache):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(str(cache), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    results = [q.get(timeout=5), q.get(timeout=5)]
    assert results[0] == results[1]
    assert len(list(cache.rglob("*.cubin"))) == 1
    assert not list(cache.rglob("*.tmp"))


def test_parse_resources():
    log = """ptxas info    : Compiling entry function 'a_main' for 'sm_90'
ptxas info    : Function properties for a_main
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'a_combine' for 'sm_90'
ptxas info    : Function properties for a_combine
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 400 bytes cmem[0]
"""
    r = compiler.parse_resources(log)
    assert r["a_main"] == compiler.Resources(255, 1024, 8, 4, 12) and r["a_main"].spills
    assert r["a_combine"] == compiler.Resources(40, 0, 0, 0, 0) and not r["a_combine"].spills


def test_build_uses_the_cache(cache):
    a = build(Problem(heads=8), naive(arch="sm_89"))
    b = build(Problem(heads=8), naive(arch="sm_89"))
    assert b.module.cached and a.module.key == b.module.key
