"""Session 29 probe: where the transposed TMA tile's refill issue goes (clock deltas on the
issuing thread, kept in registers and written once at the block's end, so no trace store sits
in the path), and how long a refill takes from its issue to its landing."""
import sys
from pathlib import Path

import cupy
import numpy as np
import torch

sys.path.insert(0, str(Path("benchmarks").resolve()))
from trace_blocks import patched_row  # noqa: E402

STEPS = ["enter -> mbar_init", "init -> proxy fence", "fence -> expect_tx", "expect -> 9 boxes issued",
         "boxes -> next page read issued", "issued -> landed (mbar_wait over)"]


def sub(src: str, old: str, new: str) -> str:
    assert src.count(old) == 1, old
    return src.replace(old, new)


def patch(plan, src: str) -> str:
    if "transposed tile" not in src:
        return src
    src = "__device__ unsigned long long probe_sum[16];\n" + src
    src = sub(src, "  // One row group's share of the work, as in mma.cu.j2",
              "  unsigned tr_acc[6] = {0, 0, 0, 0, 0, 0}, tr_n = 0, tr_m = 0, tr_issued = 0;\n"
              "  // One row group's share of the work, as in mma.cu.j2")
    src = sub(src, "      if (wt != 0) return;\n      mbar_init(stage_bar, 1);\n",
              "      if (wt != 0) return;\n      const unsigned tq0 = clock();\n      mbar_init(stage_bar, 1);\n"
              "      const unsigned tq1 = clock();\n")
    src = sub(src, "// the init -> the TMA's complete_tx\n",
              "// the init -> the TMA's complete_tx\n      const unsigned tq2 = clock();\n")
    src = sub(src, "      mbar_expect(stage_bar, 9 * KB);\n",
              "      mbar_expect(stage_bar, 9 * KB);\n      const unsigned tq3 = clock();\n")
    src = sub(src, "p.kv_map, c * 64, (kb * BN) % PAGE, page, stage_bar);\n",
              "p.kv_map, c * 64, (kb * BN) % PAGE, page, stage_bar);\n      const unsigned tq4 = clock();\n")
    src = sub(src, "      page_next = kb + 2 < kb_end ? kv_page(p, b, (kb + 2) * BN) : 0;\n",
              "      page_next = kb + 2 < kb_end ? kv_page(p, b, (kb + 2) * BN) : 0;\n"
              "      const unsigned tq5 = clock();\n"
              "      tr_acc[0] += tq1 - tq0; tr_acc[1] += tq2 - tq1; tr_acc[2] += tq3 - tq2; tr_acc[3] += tq4 - tq3;"
              " tr_acc[4] += tq5 - tq4; tr_n++; tr_issued = tq4;\n")
    wait = "      mbar_wait(stage_bar, 0);                              // a fresh mbarrier per load: phase 0\n"
    src = sub(src, wait,
              wait +
              "      if (wt == 0 && tr_issued) { tr_acc[5] += clock() - tr_issued; tr_m++; tr_issued = 0; }\n")
    src = sub(src, "  if (merging) merge_block(p, wl);\n",
              "  if (wt == 0 && tr_n) {\n"
              "    for (int k = 0; k < 5; ++k) atomicAdd(&probe_sum[8 * me + k], (unsigned long long)tr_acc[k]);\n"
              "    atomicAdd(&probe_sum[8 * me + 5], (unsigned long long)tr_acc[5]);\n"
              "    atomicAdd(&probe_sum[8 * me + 6], (unsigned long long)tr_n);\n"
              "    atomicAdd(&probe_sum[8 * me + 7], (unsigned long long)tr_m);\n  }\n"
              "  if (merging) merge_block(p, wl);\n")
    return src


def main(heads: int, batch: int, seqlen_q: int, prefix: int, variant: str) -> None:
    loaded, call = patched_row(patch, heads, batch, seqlen_q, prefix, variant)
    size = 16 * 8
    mem = cupy.cuda.UnownedMemory(loaded.module.get_global_var("probe_sum"), size, loaded.module)
    arr = cupy.ndarray((16,), dtype=cupy.uint64, memptr=cupy.cuda.MemoryPointer(mem, 0))
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    arr[:] = 0
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    s = arr.get().astype(np.float64)
    ghz = 1.75
    print(loaded.plan.name, f"(cycles and µs at {ghz} GHz, mean per refill)")
    for me in (0, 1):
        n, m = s[8 * me + 6], s[8 * me + 7]
        print(f"warpgroup {me}: {int(n)} refills, {int(m)} landings")
        for k, label in enumerate(STEPS):
            c = s[8 * me + k] / (m if k == 5 else n)
            print(f"  {label:40s} {c:8.0f} cycles {c / ghz / 1e3:6.3f} µs")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:5]), sys.argv[5])
