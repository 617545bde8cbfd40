"""mlagen: a code-generating kernel compiler for MLA verify attention (speculative decoding).

    out = mlagen.verify_attention(q, kv_cache, block_table, cache_seqlens, causal=True)

Layers, each a package, lowest first: dsl (Problem, Variant) -> plan (validate: KernelPlan) ->
codegen (Jinja, NVRTC, disk cache) -> dispatch (which variant runs a shape) -> runtime (the torch
op) -> tools (emit, launchers, bench, tune, fuzz); a module imports only from its own layer and
lower ones. `reference` is the PyTorch reference (`sparse_reference` for sparse verify, each query
token over its own top-k cache rows).
Drop-in pieces for serving engines: `verify_attention_varlen` (ragged draft counts),
`merge_states` (cascades), `verify_attention_cp_shard` (context-parallel shards),
`verify_attention_op` (the `mlagen::verify_attention` custom op, registered on import, for
torch.compile and CUDA graphs), `mlagen.compat.flash_mla` (FlashMLA's API) and
`mlagen.tools.launcher` (C++ launchers for emitted kernels).

The layers below the runtime need no torch: without it, `import mlagen` gives the names of
dsl, plan and codegen (Problem, Variant, validate, ...), and a runtime name raises an
ImportError that names the runtime extra to install (`pip install 'mlagen[runtime]'`), as does
`from mlagen import *`. Where torch is installed, `import mlagen` imports the runtime and so
registers the custom op.
"""

from __future__ import annotations

from .codegen.compiler import CompileError
from .dsl.errors import SpecError
from .dsl.spec import Problem, Variant, naive
from .plan.validate import KernelPlan, validate

try:
    import torch  # noqa: F401
except ImportError as e:        # the runtime extra is not installed: the runtime names raise on use
    _TORCH_MISSING: ImportError | None = e
else:
    _TORCH_MISSING = None
    from .runtime.context_parallel import (
        cp_global_positions,
        cp_local_seqlens,
        cp_shard_cache,
        cp_shard_mask,
        verify_attention_cp_shard,
        verify_attention_varlen_cp_shard,
    )
    from .runtime.inputs import InputError
    from .runtime.kv_formats import KVFormat, dequantize_kv, kv_format_of, quantize_kv, quantize_q
    from .runtime.merge import merge_states, merge_states_
    from .runtime.op import verify_attention
    from .runtime.ops import verify_attention_op
    from .runtime.reference import reference
    from .runtime.sparse_reference import sparse_reference
    from .runtime.varlen import verify_attention_varlen

__all__ = [
    "CompileError",
    "InputError",
    "KVFormat",
    "KernelPlan",
    "Problem",
    "SpecError",
    "Variant",
    "cp_global_positions",
    "cp_local_seqlens",
    "cp_shard_cache",
    "cp_shard_mask",
    "dequantize_kv",
    "kv_format_of",
    "merge_states",
    "merge_states_",
    "naive",
    "quantize_kv",
    "quantize_q",
    "reference",
    "sparse_reference",
    "validate",
    "verify_attention",
    "verify_attention_cp_shard",
    "verify_attention_op",
    "verify_attention_varlen",
    "verify_attention_varlen_cp_shard",
]
# The names of __all__ that the runtime (and so torch) provides.
_RUNTIME_NAMES = frozenset(__all__) - {"CompileError", "KernelPlan", "Problem", "SpecError", "Variant", "naive",
                                       "validate"}
_RUNTIME_EXTRA = "pip install 'mlagen[runtime]'"
__version__ = "0.2.0"


def __getattr__(name: str) -> object:
    """A runtime name asked for where torch is not installed: an ImportError naming the extra."""
    if name in _RUNTIME_NAMES and _TORCH_MISSING is not None:
        raise ImportError(f"mlagen.{name} runs on mlagen's runtime, which needs torch, and torch is not "
                          f"installed here ({_TORCH_MISSING}); install mlagen's runtime extra: {_RUNTIME_EXTRA}",
                          name="torch")
    raise AttributeError(f"module 'mlagen' has no attribute {name!r}")
