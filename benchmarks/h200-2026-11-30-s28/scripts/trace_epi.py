"""Session 28 probe: the transposed epilogue's phases on top of trace_blocks' stamps (slot 12:
both warpgroups past the loop; slot 9, over the work list's: the column sums done). Run from the
repository root: python3 trace_epi.py 8 16 9 16384."""

import sys

sys.path.insert(0, "benchmarks")
import trace_blocks as tb  # noqa: E402

tb.TRANSPOSED_PATCHES = tb.TRANSPOSED_PATCHES + [
    ("    __syncthreads();                                        // every wgmma and copy is done\n",
     "    __syncthreads();                                        // every wgmma and copy is done\n    TR(12);\n"),
    ("      sL[N + threadIdx.x] = l > 0.f ? 1.f / l : 0.f;\n    }\n    __syncthreads();\n",
     "      sL[N + threadIdx.x] = l > 0.f ? 1.f / l : 0.f;\n    }\n    __syncthreads(); TR(9);\n"),
]
h, b, s, pre = map(int, sys.argv[1:5])
tb.main(h, b, s, pre, warm=True, gt=True)
