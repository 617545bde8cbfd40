"""The DSL, the lowest layer: what a kernel is asked to do (`spec`: Problem, Variant, their
names), the GPU targets (`arch`), and the DSL's error type with the rule helpers that raise it
(`errors`: SpecError, require, require_smem). Imports nothing else of mlagen's.
"""
