"""The HBM rate that the kernels' way of loading KV can reach, without the rest of a kernel.

132 blocks each stream their own KV tiles (64 rows x 576 bf16 = 72 KB) through a ring of STAGES
shared-memory buffers; a tile is "used" (a fixed wait on the global timer, standing in for its
matrix work) before its buffer is refilled. Two ways to load a tile: 'boxes', the kernels' TMA
(9 boxes of 64 dims x 64 rows, 128-byte swizzle, rows 1152 B apart), and 'bulk', one contiguous
72 KB cp.async.bulk. The L2 is flushed before each launch. On the GPU machine:

    python3 benchmarks/stream_probe.py        # writes $OUT/stream_probe.txt

The global timer ticks coarsely, so a wait of W ns lasts somewhat longer (the printed
"wait-only time" is W x tiles, a lower bound); compare rows of the same wait.
"""

from __future__ import annotations

import ctypes
import os

import cupy as cp
import numpy as np
from cupy.cuda import driver

SRC = r"""
struct __align__(64) TMap { unsigned long long v[16]; };
struct __align__(64) P { TMap map; const char* src; unsigned* sink; int mode, tiles, stages, wait_ns; };
__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
extern "C" __global__ void __launch_bounds__(256) probe(const __grid_constant__ P p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) unsigned long long mbar[4];
  const unsigned base = (unsigned)__cvta_generic_to_shared(smem);
  const int TB = 64 * 1152;
  auto bar = [&](int slot) { return (unsigned)__cvta_generic_to_shared(&mbar[slot]); };
  auto issue = [&](int k) {
    if (k >= p.tiles) return;
    const int slot = k % p.stages;
    const unsigned mb = bar(slot), dst = base + slot * TB;
    const long long row0 = ((long long)blockIdx.x * p.tiles + k) * 64;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(mb), "r"(TB) : "memory");
    if (p.mode == 0) {
      for (int cb = 0; cb < 9; ++cb)
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3}], [%4];"
                     :: "r"(dst + cb * 64 * 128), "l"(&p.map), "r"(cb * 64), "r"((int)row0), "r"(mb) : "memory");
    } else {
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(dst), "l"(p.src + row0 * 1152), "r"(TB), "r"(mb) : "memory");
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar(s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int s = 0; s < p.stages; ++s) issue(s);
  unsigned sum = 0;
  for (int k = 0; k < p.tiles; ++k) {
    const int slot = k % p.stages;
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                   : "=r"(done) : "r"(bar(slot)), "r"((k / p.stages) & 1) : "memory");
    sum += reinterpret_cast<const unsigned*>(smem + slot * TB)[threadIdx.x * 71];
    if (threadIdx.x == 0 && p.wait_ns) {
      const unsigned long long t = now();
      while (now() < t + p.wait_ns) {}
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic reads before the TMA refill
    __syncthreads();
    if (threadIdx.x == 0) issue(k + p.stages);
  }
  if (sum == 0x12345678u) p.sink[0] = sum;   // keeps the reads
}
"""
BLOCKS, TILES, TILE_BYTES = 132, 32, 64 * 1152


def main() -> None:
    fn = cp.RawModule(code=SRC, options=("-arch=sm_90a", "-std=c++17")).get_function("probe")
    fn.max_dynamic_shared_size_bytes = 3 * TILE_BYTES
    rows = BLOCKS * TILES * 64
    total = rows * 1152
    src = cp.random.randint(0, 2**31, size=total // 4, dtype=cp.int64).astype(cp.int32)
    sink = cp.zeros(4, dtype=cp.uint32)
    tmap = (ctypes.c_uint64 * 16)()
    rc = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled(
        ctypes.byref(tmap),
        9,
        2,
        ctypes.c_void_p(src.data.ptr),
        (ctypes.c_uint64 * 2)(576, rows),
        (ctypes.c_uint64 * 1)(1152),
        (ctypes.c_uint32 * 2)(64, 64),
        (ctypes.c_uint32 * 2)(1, 1),
        0,
        3,
        3,
        0,
    )
    assert rc == 0, f"cuTensorMapEncodeTiled: {rc}"
    flush = cp.zeros(256 << 20, dtype=cp.uint8)
    out = open(os.path.join(os.environ.get("OUT", "."), "stream_probe.txt"), "w")

    def say(line: str) -> None:
        print(line)
        print(line, file=out, flush=True)

    say(f"{BLOCKS} blocks x {TILES} tiles of 72 KB = {total / 1e6:.0f} MB from HBM (L2 flushed before each launch)")
    for wait in (0, 1700, 3400):
        for stages in (1, 2, 3):
            for mode, name in ((0, "boxes"), (1, "bulk ")):
                params = bytes(tmap) + np.array([src.data.ptr, sink.data.ptr], dtype=np.uint64).tobytes()
                params += np.array([mode, TILES, stages, wait], dtype=np.int32).tobytes()
                buf = ctypes.create_string_buffer(256)
                addr = (ctypes.addressof(buf) + 63) // 64 * 64  # the tensor map wants 64-byte alignment
                ctypes.memmove(addr, params, len(params))
                argv = (ctypes.c_void_p * 1)(addr)
                times = []
                for _ in range(7):
                    flush.fill(1)
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record()
                    driver.launchKernel(
                        fn.kernel.ptr, BLOCKS, 1, 1, 256, 1, 1, stages * TILE_BYTES, 0, ctypes.addressof(argv), 0
                    )
                    e1.record()
                    e1.synchronize()
                    times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
                us = float(np.median(times))
                say(
                    f"wait {wait:4d} ns/tile  stages {stages}  {name}: {us:7.1f} us  {total / us / 1e6:5.2f} TB/s  "
                    f"(wait-only time {TILES * wait / 1e3:.0f} us)"
                )


if __name__ == "__main__":
    main()
