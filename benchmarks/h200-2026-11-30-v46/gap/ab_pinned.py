"""16/64/4/4096: the aligned balanced split (dispatch), the same with 128 ranges pinned, the fixed split of 2; two rounds."""
import os
import torch
from mlagen.grids import Row
from mlagen.spec import parse_variant
from mlagen.testing import pinned_balanced_ranges
from mlagen.timing import l2_bytes, measure
from mlagen.workload import make_workload, mlagen_call
w = make_workload(Row(16, 64, 4, 4096), 64, "causal", "bf16", l2_bytes(0))
spb = parse_variant("mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a")
sp2 = parse_variant("mma_ht16_qt4_bn64_w8_st2_sp2_p16_tma_ss_sm90a")
measure(mlagen_call(w, spb), w.sets)
cells = []
for _ in range(2):
    cells.append("spb=%.2f" % measure(mlagen_call(w, spb), w.sets).us)
    for r in (128, 130):
        with pinned_balanced_ranges(r):
            cells.append("spb@%d=%.2f" % (r, measure(mlagen_call(w, spb), w.sets).us))
    cells.append("sp2=%.2f" % measure(mlagen_call(w, sp2), w.sets).us)
line = " ".join(cells)
print(line)
open(os.path.join(os.environ["OUT"], "ab_pinned.txt"), "w").write(line + "\n")
