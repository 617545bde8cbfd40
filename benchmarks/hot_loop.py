"""Where a kernel's tile loop lies in its SASS: the kernel's size, the loop's byte range and how
much of it lies past the kernel's first 64 KB (no GPU; needs nvdisasm, as `mlagen show --sass`).

Session 21 found the seesaw's stalls on instruction fetch growing with the part of its tile loop
that lies past 64 KB (benchmarks/NOTES.md, "v47"); this prints that for any variant:

    python3 benchmarks/hot_loop.py 16 mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a [more variants]

The tile loop is `mlagen.sass.tile_loop`'s: the narrowest backward branch whose range holds nine
tenths of the kernel's matrix instructions.
"""

from __future__ import annotations

import sys

from mlagen.build import build
from mlagen.sass import disassemble, instructions, tile_loop
from mlagen.spec import Problem, parse_variant

WINDOW = 64 * 1024


def main(heads: int, names: list[str]) -> None:
    for name in names:
        built = build(Problem(heads=heads), parse_variant(name))
        text = disassemble(built.module.cubin, built.plan.main_kernel, built.plan.arch.name)
        code = instructions(text)
        size = code[-1][0] + 16
        loop = tile_loop(text)
        where = (f"tile loop {loop[0]:#x}..{loop[1]:#x} ({(loop[1] - loop[0]) / 1024:.1f} KB), "
                 f"{max(0, loop[1] - max(loop[0], WINDOW)) / 1024:.1f} KB of it past 64 KB") if loop else "no tile loop"
        print(f"{name}: {len(code)} instructions ({size / 1024:.1f} KB), {where}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(int(sys.argv[1]), sys.argv[2:])
