"""Writes the example's kernel, its launcher header and two small wrappers into a build folder.

    python generate.py --arch sm_90 --out build

build/<kernel>.cu and build/<kernel>_launch.h come from mlagen (the same files as
`mlagen emit --launcher`); build/kernel.cu includes the former (the kernels' translation unit)
and build/variant.h includes the latter and names its namespace `kernel` for main.cu.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from mlagen.dispatch.policy import H200, heuristic_variant
from mlagen.dsl.spec import Problem, Variant
from mlagen.plan.validate import validate
from mlagen.tools.emit import emit_one
from mlagen.tools.launcher import emit_launcher, header_name, namespace

# Kimi K2 sharded 8 ways (8 heads per GPU), bf16, 16-row pages, causal, with lse.
PROBLEM = Problem(heads=8, dl=512, dr=64, dtype="bf16", page_size=16, mask="causal", lse=True)
SEQLEN_Q = 4


def generate(arch: str, out: Path, part16: bool = False, tma: bool = False, seesaw: bool = False,
             transposed: bool = False) -> Path:
    """Writes the files for `arch` into `out` (with 16-bit partial rows: `part16`, mma family
    only; TMA tile loads: `tma`, and the seesaw schedule on them: `seesaw`, both sm_90a with
    64-row pages; the transposed tile of all 32 rows: `transposed`, sm_90a); returns the kernel
    source's path."""
    problem = dataclasses.replace(PROBLEM, page_size=64) if tma else PROBLEM
    partials = "16bit" if part16 else "fp32"
    if transposed:   # the sm_90a tile whose wgmma N is the 8 heads x 4 positions themselves
        variant = Variant(family="mma", head_tile=8, q_tile=SEQLEN_Q, block_n=64, warps=8, stages=2, arch=arch,
                          partials=partials, schedule="transposed")
    elif tma:   # the sm_90a wgmma kernel, all 8 heads of 8 positions a block
        variant = Variant(family="mma", head_tile=8, q_tile=8, block_n=64, warps=8, stages=2, arch=arch,
                          partials=partials, loads="tma", schedule="seesaw" if seesaw else "lockstep")
    else:
        variant = heuristic_variant(problem, SEQLEN_Q, arch, H200).with_(partials=partials)
    plan = validate(problem, variant)
    emitted = emit_one(problem, plan.variant, out)
    emit_launcher(plan, out)
    (out / "kernel.cu").write_text(f'#include "{emitted.source.name}"\n')
    (out / "variant.h").write_text(
        f'#include "{header_name(plan)}"\n'
        f"namespace kernel = mlagen::{namespace(plan)};\n"
        f"constexpr int kSeqlenQ = {SEQLEN_Q};\n")
    return emitted.source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", help="compile target, e.g. sm_80, sm_90, sm_120")
    parser.add_argument("--out", type=Path, default=Path("build"))
    parser.add_argument("--part16", action="store_true", help="the variant with 16-bit partial rows")
    parser.add_argument("--tma", action="store_true", help="TMA tile loads (--arch sm_90a; 64-row pages)")
    parser.add_argument("--seesaw", action="store_true", help="the seesaw schedule (with --tma)")
    parser.add_argument("--transposed", action="store_true", help="the transposed tile (--arch sm_90a)")
    args = parser.parse_args()
    if args.seesaw and not args.tma:
        parser.error("--seesaw needs --tma")
    if args.transposed and (args.tma or args.seesaw):
        parser.error("--transposed loads its own tiles: no --tma or --seesaw")
    print(generate(args.arch, args.out, args.part16, args.tma, args.seesaw, args.transposed))


if __name__ == "__main__":
    main()
