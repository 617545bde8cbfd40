"""A/B of one of mlagen.plan.validate's int constants or of the dispatch policy's int thresholds in one
process: each value's launches of the dispatcher's pick timed in turn, round after round, on the
bench's inputs (CUDA graph replay, rotated past the L2).

    python3 benchmarks/ab_constant.py ROUNDS NAME=V1,V2,... 'H,B,S,prefix' ...
    python3 benchmarks/ab_constant.py 5 MERGE_TARGET_BLOCKS=128,144 8,16,9,16384 8,16,9,8192

NAME is a module-level int of mlagen/plan/validate.py that the rendered kernels or the launch read
(MERGE_TARGET_BLOCKS, SEGMENT_TILES, ...), or, written policy.H200.NAME, an int threshold of the
dispatch policy (a field of `mlagen.dispatch.policy.DispatchPolicy`, e.g.
policy.H200.pdl_tiles_per_sm): `policy.H200`'s, which every device's policy (`policy.policy_for`)
takes. Each value renders and compiles its own kernels, and the dispatcher's memos are cleared
between values. Prints each value's µs per round and its best.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from ab_trees import parse_cells, print_times, row_cells, use_templates
from bench_cli import ROOT, parser, require_gpu

from mlagen.dispatch import policy
from mlagen.plan import validate
from mlagen.tools import launcher
from mlagen.tools.timing import measure
from mlagen.tools.workload import mlagen_call

# The device's own figures, which every device's policy replaces: not thresholds to A/B.
DEVICE_FIELDS = ("sm_count", "smem_per_block")


def constant(name: str) -> tuple[object, str]:
    """(the owner, the attribute) that NAME (mlagen.plan.validate's) or policy.H200.NAME (a field of
    `policy.H200`) names; exits where it is no int threshold."""
    if name.startswith("policy."):
        owner, attr = policy.H200, name.removeprefix("policy.H200.")
        if attr not in {f.name for f in dataclasses.fields(owner)} - set(DEVICE_FIELDS):
            raise SystemExit(f"{name}: expected policy.H200.NAME, NAME an int threshold of policy.DispatchPolicy")
    else:
        owner, attr = validate, name
    value = getattr(owner, attr, None)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SystemExit(f"{name} is not an int constant")
    return owner, attr


def set_constant(name: str, value: int) -> None:
    """mlagen.plan.validate.`name` = value, and the copies modules imported; or, as policy.H200.NAME,
    `policy.H200` with that field = value (every device's policy follows it); every memo dropped."""
    owner, name = constant(name)
    if owner is policy.H200:
        policy.H200 = dataclasses.replace(policy.H200, **{name: value})
    else:
        old = getattr(owner, name)
        for module in (validate, policy, launcher):
            if module is owner or getattr(module, name, None) == old:
                setattr(module, name, value)
    for fn in vars(policy).values():
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    use_templates(ROOT)


def parse_setting(text: str) -> tuple[str, list[int]]:
    """'NAME=V1,V2,...' as (NAME, [V1, V2, ...]), NAME checked."""
    name, _, values_text = text.partition("=")
    try:
        values = [int(v) for v in values_text.split(",")]
    except ValueError:
        raise SystemExit(f"{text!r}: expected NAME=V1,V2,... with int values") from None
    constant(name)
    return name, values


def parse_args(argv: list[str]) -> tuple[int, tuple[str, list[int]], list[str]]:
    p = parser(__file__, __doc__)
    p.add_argument("rounds", type=int, help="rounds: every value timed once a round")
    p.add_argument("setting", help="NAME=V1,V2,...")
    p.add_argument("rows", nargs="+", help="H,B,S,prefix")
    args = p.parse_args(argv)
    for row in args.rows:
        parse_cells(row + "=x/dispatch")
    return args.rounds, parse_setting(args.setting), args.rows


def main(rounds: int, setting: tuple[str, list[int]], rows: list[str]) -> None:
    name, values = setting
    for row in rows:
        row_text, work, _ = row_cells(row + "=x/dispatch")
        times: dict[int, list[float]] = {v: [] for v in values}
        for _ in range(rounds):
            for v in values:
                set_constant(name, v)
                times[v].append(measure(mlagen_call(work, None), work.sets).us)
        for v, us in times.items():
            print_times(row_text, f"{name} {v}", us)
        del work
        torch.cuda.empty_cache()


if __name__ == "__main__":
    parsed = parse_args(sys.argv[1:])
    require_gpu(__file__)
    main(*parsed)
