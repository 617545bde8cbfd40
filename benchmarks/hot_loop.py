"""Where a kernel's tile loop lies in its SASS: the kernel's size, the loop's byte range and how
much of it lies past the kernel's first 64 KB (no GPU; needs nvdisasm, as `mlagen show --sass`).

Session 21 found the seesaw's stalls on instruction fetch growing with the part of its tile loop
that lies past 64 KB (benchmarks/NOTES.md, "v47"); this prints that for any variant:

    python3 benchmarks/hot_loop.py 16 mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a [more variants]

The tile loop is taken to be the narrowest backward branch whose range holds nine tenths of the
kernel's matrix instructions (HGMMA, or HMMA on mma.sync kernels).
"""

from __future__ import annotations

import re
import sys

from mlagen.build import build
from mlagen.sass import disassemble
from mlagen.spec import Problem, parse_variant

_LINE = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*)")
WINDOW = 64 * 1024


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(byte offset, opcode, operands) of every instruction."""
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_LINE.match, sass.splitlines()) if m]


def tile_loop(code: list[tuple[int, str, str]]) -> tuple[int, int] | None:
    """[start, end) in bytes of the narrowest backward branch that holds nine tenths of the kernel's
    matrix instructions (HGMMA, or HMMA on mma.sync kernels): its tile loop."""
    matrix = [a for a, op, _ in code if op.startswith(("HGMMA", "HMMA"))]
    loops = [(int(t.group(1), 16), a + 16) for a, op, rest in code if op.startswith("BRA")
             if (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < a]
    held = [(lo, hi) for lo, hi in loops if 10 * sum(lo <= m < hi for m in matrix) >= 9 * len(matrix)]
    return min(held, key=lambda r: r[1] - r[0], default=None)


def main(heads: int, names: list[str]) -> None:
    for name in names:
        built = build(Problem(heads=heads), parse_variant(name))
        code = instructions(disassemble(built.module.cubin, built.plan.main_kernel, built.plan.arch.name))
        size = code[-1][0] + 16
        loop = tile_loop(code)
        where = (f"tile loop {loop[0]:#x}..{loop[1]:#x} ({(loop[1] - loop[0]) / 1024:.1f} KB), "
                 f"{max(0, loop[1] - max(loop[0], WINDOW)) / 1024:.1f} KB of it past 64 KB") if loop else "no tile loop"
        print(f"{name}: {len(code)} instructions ({size / 1024:.1f} KB), {where}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(int(sys.argv[1]), sys.argv[2:])
