"""Where a kernel's tile loop lies in its SASS: the kernel's size, the loop's byte range and how
much of it lies past the kernel's first 64 KB (no GPU; needs nvdisasm, as `mlagen show --sass`).

On the H200 a kernel's warps stall on instruction fetch more often the more of its tile loop
lies past its first 64 KB of code; this prints that for any variant (heads, then variant names):

    python3 benchmarks/hot_loop.py 16 mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a [more variants]

The tile loop is `mlagen.tools.sass.tile_loop`'s: the narrowest backward branch whose range holds nine
tenths of the kernel's matrix instructions.
"""

from __future__ import annotations

import sys

from bench_cli import parser, variant_name

from mlagen.codegen.build import build
from mlagen.dsl.spec import Problem, parse_variant
from mlagen.tools.sass import disassemble, instructions, tile_loop

WINDOW = 64 * 1024


def report(heads: int, name: str) -> str:
    """One line: variant `name`'s main kernel (for `heads` heads), its size and its tile loop."""
    built = build(Problem(heads=heads), parse_variant(name))
    text = disassemble(built.module.cubin, built.plan.main_kernel, built.plan.arch.name)
    code = instructions(text)
    size = code[-1][0] + 16
    loop = tile_loop(text)
    where = (f"tile loop {loop[0]:#x}..{loop[1]:#x} ({(loop[1] - loop[0]) / 1024:.1f} KB), "
             f"{max(0, loop[1] - max(loop[0], WINDOW)) / 1024:.1f} KB of it past 64 KB") if loop else "no tile loop"
    return f"{name}: {len(code)} instructions ({size / 1024:.1f} KB), {where}"


def parse_args(argv: list[str]):
    p = parser(__file__, __doc__)
    p.add_argument("heads", type=int)
    p.add_argument("names", nargs="+", type=variant_name, metavar="variant")
    return p.parse_args(argv)


def main(heads: int, names: list[str]) -> None:
    for name in names:
        print(report(heads, name), flush=True)


if __name__ == "__main__":
    main(**vars(parse_args(sys.argv[1:])))
