"""The 72-row tile split over a 2-block cluster by dims (NOTES "What is left" 0d), its loads and
its exchange measured before any template work.

Today's transposed tile (8/16/9/16k) holds Q (83 KB) and two 72 KB stages, one per warpgroup, so
a stage's cycle is its load plus its hold and the SM's share of HBM idles between them. The design
to measure: a cluster of two blocks splits the 576 dims. Each block holds half of Q and half of
each tile (value blocks 0-3 or 4-7, and half the rope block: 36 KB), so each warpgroup gets two
stages; each block computes its half of S^T, the halves are summed through distributed shared
memory (64 keys x 72 columns of fp32, 18 KB each way a tile), and each adds P V into its own 256
value dims. This probe runs that launch's skeleton with the compute replaced by a spin:

- `full`: today's loads. 132 blocks, a warpgroup takes every other tile of its block's range into
  its one 72 KB stage (9 TMA boxes).
- `half`: the design's loads. 66 clusters of two; a cluster's range is the same tiles for both
  blocks, each block loads its 36 KB of a tile (4 boxes of 64 dims and the rope block's 32 rows of
  its half; the bytes of a 32-dim box), and a warpgroup has two stages.
- `half+x`: `half` with the exchange. After its tile lands (and the first spin), each thread
  stores its 36 fp32 into the peer block's slot for its warpgroup (9 16-byte stores through the
  cluster window) and arrives on the peer's mbarrier; it then waits for the peer's 36 on its own,
  adds them, and tells the peer its slot is free again. A warpgroup's slot takes one tile at a
  time (18 KB a warpgroup: the design's shared memory has no room for two).
- `half+xc`: the same stores laid out so that each store instruction of a warp writes 512
  contiguous bytes.
- `half+xb`: the warpgroup writes its half into a slot of its own block, and one thread sends it
  to the peer with a bulk copy counted by the peer's mbarrier.

Each tile is held for a spin of HOLD cycles (split in two around the exchange) standing for the
scores, the softmax and P V. The loads are real (the tiles come from HBM, a different range per
block or cluster), the exchanged values are checked, and the stage's bytes are read before it is
refilled. Printed per mode and hold: µs per launch and per tile of a block's (or cluster's) range,
and for `half+x` the exchange's latency per tile (send to receive, clock64 at 1.98 GHz).

    python3 benchmarks/cluster_exchange_probe.py [tiles=4096] [holds=0,2000,4000,6000]

4096 tiles of 64 keys are 8/16/9/16k's; a hold of ~4000 cycles (2 µs) a tile is where today's
transposed tile runs (a pair of ~5.4 µs, load ~2.3). Results go to $OUT/cluster_exchange_probe.txt;
session 27's are in benchmarks/h200-2026-11-30-s27/probe/ and NOTES.md ("Session 27": the exchange
costs 1.4-2.4 µs a tile, more than the loads it saves).
"""

from __future__ import annotations

import ctypes
import os
import sys

import cupy as cp
import numpy as np
import torch
from cupy.cuda import driver
from transposed_probe import timed

from mlagen.tensormap import encode

SOURCE = r"""
#include <cuda_bf16.h>
struct __align__(64) TMap { unsigned long long v[16]; };
struct __align__(64) Params {
  TMap map64, map32;       // boxes of [64 dims, 64 rows] and [64 dims, 32 rows] of a page
  float* out;              // [blocks][256] each thread's sum of what it read
  long long* trace;        // [blocks][2]: per warpgroup, clock64 spent from send to receive
  int tiles, ranges, hold1, hold2;
};
constexpr int STAGE_BYTES = HALF ? 4 * 8192 + 4096 : 9 * 8192;
constexpr int SPW = HALF ? 2 : 1;                    // stages a warpgroup
constexpr int SLOT = 64 * 72 * 4;                    // a warpgroup's exchange slot: S^T in fp32
constexpr int SLOTS = 4 * 36864, BARS = SLOTS + 4 * SLOT;   // stages take 147,456 bytes either way; slots in, out
// mbarriers: full[4] (a stage landed), xfull[2] (the peer's half of S^T is here), xempty[2] (the
// peer has read what this block sent, so its slot takes the next)
extern __shared__ __align__(1024) unsigned char smem[];

__device__ __forceinline__ void spin(int cycles) {
  const long long t = clock64();
  while (clock64() - t < cycles) {}
}
__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, int parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void expect(unsigned bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma3(unsigned dst, const TMap* map, int x, int y, int z, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1, { %2, %3, %4 }], [%5];\n"
               :: "r"(dst), "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar) : "memory");
}
__device__ __forceinline__ unsigned peer_addr(unsigned addr, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void remote_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(256, 1) CLUSTER_DIMS probe(const __grid_constant__ Params p) {
  const unsigned base = (unsigned)__cvta_generic_to_shared(smem);
  const int wg = threadIdx.x / 128, wt = threadIdx.x % 128;
  unsigned rank = 0;
  if (HALF) asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  const int range = HALF ? blockIdx.x / 2 : blockIdx.x;
  const int t0 = (int)((long long)range * p.tiles / p.ranges), t1 = (int)((long long)(range + 1) * p.tiles / p.ranges);
  const int count = (t1 - t0 - wg + 1) / 2;          // this warpgroup's tiles: t0 + wg, t0 + wg + 2, ...
  const unsigned full = base + BARS, xfull = full + 32, xempty = xfull + 16;
  if (threadIdx.x == 0) {
    for (int s = 0; s < 4; ++s) mbar_init(full + 8 * s, 1);
    for (int w = 0; w < 2; ++w) { mbar_init(xfull + 8 * w, EXCHANGE == 3 ? 1 : 128); mbar_init(xempty + 8 * w, 128); }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (HALF) cluster_sync(); else __syncthreads();

  auto issue = [&](int i) {
    if (wt != 0 || i >= count) return;
    const int st = wg * SPW + i % SPW, page = t0 + wg + 2 * i;
    const unsigned dst = base + st * STAGE_BYTES, bar = full + 8 * st;
    expect(bar, STAGE_BYTES);
    if (HALF) {
      for (int c = 0; c < 4; ++c) tma3(dst + c * 8192, &p.map64, (4 * rank + c) * 64, 0, page, bar);
      tma3(dst + 4 * 8192, &p.map32, 512, 32 * rank, page, bar);
    } else {
      for (int c = 0; c < 9; ++c) tma3(dst + c * 8192, &p.map64, c * 64, 0, page, bar);
    }
  };
  for (int i = 0; i < SPW; ++i) issue(i);
  float acc = 0.f;
  long long xtime = 0;
  const unsigned slot = base + SLOTS + wg * SLOT + wt * STRIDE;   // a thread's 36 floats: 9 x 16 bytes, Q_STEP apart
  const unsigned peer_slot = HALF ? peer_addr(slot, rank ^ 1) : 0;
  const unsigned peer_xfull = HALF ? peer_addr(xfull + 8 * wg, rank ^ 1) : 0;
  const unsigned peer_xempty = HALF ? peer_addr(xempty + 8 * wg, rank ^ 1) : 0;
  for (int i = 0; i < count; ++i) {
    const int st = wg * SPW + i % SPW;
    mbar_wait(full + 8 * st, (i / SPW) & 1);
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(base + st * STAGE_BYTES + wt * 16));
    acc += v.x;
    spin(p.hold1);
    if (EXCHANGE) {
      const long long ts = clock64();
#if EXCHANGE == 3
      // through a bulk copy: the warpgroup's half into its own out slot, then one thread copies
      // the slot into the peer's, counted by the peer's mbarrier
      if (wt == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");   // the last copy read it
      asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg) : "memory");
      const unsigned out_slot = base + SLOTS + (2 + wg) * SLOT;
      for (int q = 0; q < 9; ++q) {
        const float x = (float)(i + wt + q);
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(out_slot + wt * STRIDE + Q_STEP * q), "f"(x), "f"(x), "f"(x), "f"(x) : "memory");
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg) : "memory");
      if (wt == 0) {
        expect(xfull + 8 * wg, SLOT);                  // this phase's arrival and the bytes it waits for
        if (i > 0) mbar_wait(xempty + 8 * wg, (i - 1) & 1);   // the peer read our last send
        asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                     "cp.async.bulk.commit_group;\n"
                     :: "r"(peer_addr(base + SLOTS + wg * SLOT, rank ^ 1)), "r"(out_slot), "r"(SLOT), "r"(peer_xfull)
                     : "memory");
      }
#else
      if (i > 0) mbar_wait(xempty + 8 * wg, (i - 1) & 1);   // the peer read our last send
      for (int q = 0; q < 9; ++q) {
        const float x = (float)(i + wt + q);
        asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(peer_slot + Q_STEP * q), "f"(x), "f"(x), "f"(x), "f"(x) : "memory");
      }
      remote_arrive(peer_xfull);
#endif
      mbar_wait(xfull + 8 * wg, i & 1);
      for (int q = 0; q < 9; ++q) {
        float4 r;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
                     : "r"(slot + Q_STEP * q) : "memory");
        acc += r.x + r.y + r.z + r.w;
      }
      remote_arrive(peer_xempty);
      xtime += clock64() - ts;
    }
    spin(p.hold2);
    asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg) : "memory");   // the warpgroup is done with the stage
    issue(i + SPW);
  }
  p.out[blockIdx.x * 256 + threadIdx.x] = acc;
  if (wt == 0) p.trace[blockIdx.x * 2 + wg] = xtime;
  if (HALF) cluster_sync();                          // no block leaves while its peer may still write to it
}
"""

MODES = {"full": (0, 0), "half": (1, 0), "half+x": (1, 1), "half+xc": (1, 2), "half+xb": (1, 3)}   # (HALF, EXCHANGE)
SMEM = 4 * 36864 + 4 * 64 * 72 * 4 + 64
GHZ = 1.98


def source(mode: str) -> str:
    """The probe kernel's CUDA source for `mode` (a key of MODES)."""
    half, exchange = MODES[mode]
    # a thread's 16-byte pieces: contiguous (144 bytes a thread), or a warp's 32 pieces of each
    # store contiguous (`half+xc`: 512 bytes an instruction)
    stride, step = (16, 2048) if exchange >= 2 else (144, 16)
    return (f"#define HALF {half}\n#define EXCHANGE {exchange}\n#define STRIDE {stride}\n#define Q_STEP {step}\n"
            f"#define CLUSTER_DIMS {'__cluster_dims__(2, 1, 1)' if half else ''}\n" + SOURCE)


def kernel(mode: str) -> cp.RawKernel:
    """The probe kernel for `mode`, compiled and loaded, with the shared memory it asks for."""
    fn = cp.RawModule(code=source(mode), options=("-arch=sm_90a", "-std=c++17")).get_function("probe")
    fn.max_dynamic_shared_size_bytes = SMEM
    return fn


def exchange_sums(blocks: int, tiles: int, ranges: int) -> torch.Tensor:
    """What the exchange adds to each thread's `acc` in `half+x` ([blocks, 256]): per tile i of its
    warpgroup, the peer's 9 stores of 4 x (i + wt + q)."""
    out = torch.zeros(blocks, 256, dtype=torch.float64)
    wt = torch.arange(128, dtype=torch.float64)
    for blk in range(blocks):
        t0, t1 = (blk // 2) * tiles // ranges, (blk // 2 + 1) * tiles // ranges
        for wg in range(2):
            for i in range((t1 - t0 - wg + 1) // 2):
                out[blk, 128 * wg:128 * wg + 128] += 4 * (9 * (i + wt) + 36)
    return out


def main() -> None:
    tiles = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    holds = [int(h) for h in (sys.argv[2] if len(sys.argv) > 2 else "0,2000,4000,6000").split(",")]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count // 2 * 2
    kv = torch.randn(tiles, 64, 576, device=dev).to(torch.bfloat16)
    out = torch.empty(sms, 256, device=dev)
    trace = torch.zeros(sms, 2, dtype=torch.int64, device=dev)
    lines = [f"{torch.cuda.get_device_name(dev)}, {tiles} tiles of 64 keys x 576 dims ({tiles * 73728 / 1e6:.0f} MB), "
             f"{sms} blocks"]
    params_base = encode(kv.data_ptr(), tiles, 64, 576, (64 * 576, 576), "bf16", 64)
    params_base += encode(kv.data_ptr(), tiles, 64, 576, (64 * 576, 576), "bf16", 32)
    sums = {}
    for mode, (half, exchange) in MODES.items():
        fn = kernel(mode)
        ranges = sms // 2 if half else sms
        for hold in holds:
            params = params_base + np.array([out.data_ptr(), trace.data_ptr()], dtype=np.uint64).tobytes()
            params += np.array([tiles, ranges, hold // 2, hold - hold // 2], dtype=np.int32).tobytes()
            buf = ctypes.create_string_buffer(len(params) + 128)
            addr = (ctypes.addressof(buf) + 63) // 64 * 64          # the tensor maps want 64-byte alignment
            ctypes.memmove(addr, params, len(params))
            argv = (ctypes.c_void_p * 1)(addr)

            def launch(fn=fn, argv=argv) -> None:
                driver.launchKernel(fn.kernel.ptr, sms, 1, 1, 256, 1, 1, SMEM,
                                    torch.cuda.current_stream().cuda_stream, ctypes.addressof(argv), 0)

            out.fill_(float("nan"))
            trace.zero_()
            launch()
            torch.cuda.synchronize()
            got = out.double().cpu()
            sums[(mode, hold)] = got
            us = timed(launch)
            per_range = tiles / ranges
            text = (f"{mode:7s} hold {hold:5d} cycles ({hold / GHZ / 1e3:.2f} µs): {us:7.1f} µs a launch, "
                    f"{us / per_range:5.2f} µs a tile of a {'cluster' if half else 'block'}'s range "
                    f"({per_range:.1f} tiles), {tiles * 73728 / us / 1e6:.2f} TB/s")
            if exchange:
                x = trace.double().cpu() / (per_range / 2) / GHZ / 1e3
                text += f"; exchange {x.mean():.2f} µs a tile (max {x.max():.2f})"
                # the stage words are what `half` read at the same hold; the peer's part is exact
                peer = exchange_sums(sms, tiles, ranges)
                err = (got - sums[("half", hold)] - peer).abs().max().item()
                text += f"; check {'ok' if err < 1e-3 * peer.abs().max().item() else f'FAILED ({err:.3g})'}"
            if not torch.isfinite(got).all():
                text += "; UNWRITTEN OUTPUT"
            text += f"; registers {fn.num_regs}, local {fn.local_size_bytes} B"
            lines.append(text)
            print(text, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "cluster_exchange_probe.txt"), "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
