"""Session 27's A/B of v54: the transposed tile's split unit, 1 (main before v54) against 2,
in one process on the same templates. Each arm runs twice a round (labels main, pairs, main2,
pairs2), so a drift within the process shows.

    python3 ab_unit.py ROUNDS 'H,B,S,prefix' ...   (run from the repository root)
"""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
import ab_trees  # noqa: E402

from mlagen import dispatch  # noqa: E402

validate = importlib.import_module("mlagen.validate")
one_unit = validate.split_unit


def pairs(variant):
    return 2 if variant.seesaw or variant.transposed else 1


def cell_call(work, trees, cell):
    tree, variant = cell
    unit = pairs if tree.startswith("pairs") else one_unit
    validate.split_unit = dispatch.split_unit = unit
    for fn in vars(dispatch).values():
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    ab_trees.use_templates(Path("."))
    return ab_trees.mlagen_call(work, None if variant == "dispatch" else ab_trees.parse_variant(variant))


ab_trees.cell_call = cell_call
cells = "main/dispatch|pairs/dispatch|main2/dispatch|pairs2/dispatch"
ab_trees.main(int(sys.argv[1]), dict.fromkeys(("main", "pairs", "main2", "pairs2"), Path(".")),
              [row + "=" + cells for row in sys.argv[2:]])
