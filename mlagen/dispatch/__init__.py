"""Dispatch, above code generation: which variant runs a shape. `policy` is the dispatcher
(tuned tables first, then the heuristics), `tables` its tuned tables (the shipped ones in
tables/), `heuristic` the tensor-core family's tile choice, `presets` the named problems and the
variants `mlagen emit` writes for them.
"""
