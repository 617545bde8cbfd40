"""mlagen: a code-generating kernel compiler for MLA verify attention (speculative decoding).

    out = mlagen.verify_attention(q, kv_cache, block_table, cache_seqlens, causal=True)

Layers, each a module: spec (the DSL) -> validate (plans) -> codegen (Jinja) -> compiler
(NVRTC, disk cache) -> launch/runtime (torch op). `reference` is the PyTorch reference.
"""

from .compiler import CompileError
from .inputs import InputError
from .reference import reference
from .runtime import verify_attention
from .spec import Problem, Variant, naive
from .validate import KernelPlan, SpecError, validate

__all__ = [
    "CompileError",
    "InputError",
    "KernelPlan",
    "Problem",
    "SpecError",
    "Variant",
    "naive",
    "reference",
    "validate",
    "verify_attention",
]
__version__ = "0.1.0"
