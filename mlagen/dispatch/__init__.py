"""Dispatch, above code generation: which variant runs a shape. `policy` is the dispatcher
(tuned tables first, then the heuristics, every threshold in its `DispatchPolicy`, built per
device), `tables` its tuned tables (the shipped ones in tables/), `presets` the named problems
and the variants `mlagen emit` writes for them.
"""
