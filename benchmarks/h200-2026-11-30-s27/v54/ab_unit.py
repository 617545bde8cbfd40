"""A/B of the transposed tile's split unit (1 = main, 2 = wip/tr-pairs) in one process.
    python3 dev/ab_unit.py ROUNDS 'H,B,S,prefix' ...   (cells: main/dispatch, pairs/dispatch)"""
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
import ab_trees
import importlib
from mlagen import dispatch
validate = importlib.import_module("mlagen.validate")

orig = validate.split_unit
def pairs(v):
    return 2 if v.seesaw or v.transposed else 1

def cell_call(work, trees, cell):
    tree, variant = cell
    f = pairs if tree == "pairs" else orig
    validate.split_unit = f
    dispatch.split_unit = f
    for name in dir(dispatch):
        fn = getattr(dispatch, name)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    ab_trees.use_templates(Path("."))
    return ab_trees.mlagen_call(work, None if variant == "dispatch" else ab_trees.parse_variant(variant))

ab_trees.cell_call = cell_call
rounds = int(sys.argv[1])
rows = [r + "=main/dispatch|pairs/dispatch|main/dispatch|pairs/dispatch" if "=" not in r else r for r in sys.argv[2:]]
# duplicate cells would collide in the dict: give the second copy a distinct tree label
rows = [r.replace("main/dispatch|pairs/dispatch|main/dispatch|pairs/dispatch", "main/dispatch|pairs/dispatch|main2/dispatch|pairs2/dispatch") for r in rows]
def cc(work, trees, cell):
    t, v = cell
    return cell_call(work, trees, (t.rstrip("2"), v))
ab_trees.cell_call = cc
ab_trees.main(rounds, {"main": Path("."), "pairs": Path("."), "main2": Path("."), "pairs2": Path(".")}, rows)
