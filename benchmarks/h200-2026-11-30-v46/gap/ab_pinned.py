"""What produced ab_pinned.txt (run with PYTHONPATH at the repository): H=16 B=64 S=4 at 4096 keys,
the aligned balanced split (one range per resident slot), the same with 128 and 130 ranges pinned,
and the fixed split of 2, alternated, two rounds, device µs under graph replay."""

import os

from mlagen.grids import Row
from mlagen.spec import parse_variant
from mlagen.testing import pinned_balanced_ranges
from mlagen.timing import l2_bytes, measure
from mlagen.workload import make_workload, mlagen_call

work = make_workload(Row(16, 64, 4, 4096), 64, "causal", "bf16", l2_bytes(0))
spb = parse_variant("mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a")
sp2 = parse_variant("mma_ht16_qt4_bn64_w8_st2_sp2_p16_tma_ss_sm90a")
measure(mlagen_call(work, spb), work.sets)
cells = []
for _ in range(2):
    cells.append(f"spb={measure(mlagen_call(work, spb), work.sets).us:.2f}")
    for ranges in (128, 130):
        with pinned_balanced_ranges(ranges):
            cells.append(f"spb@{ranges}={measure(mlagen_call(work, spb), work.sets).us:.2f}")
    cells.append(f"sp2={measure(mlagen_call(work, sp2), work.sets).us:.2f}")
line = " ".join(cells)
print(line)
with open(os.path.join(os.environ["OUT"], "ab_pinned.txt"), "w") as f:
    f.write(line + "\n")
