"""mlagen inside real models: Hugging Face transformers' DeepSeek-V3 (and Kimi K2) with its
attention run as absorbed MLA over a paged latent cache, for verify steps of speculative decoding.

    from mlagen.integrations import DeepseekV3Verifier, lookup_tree, speculative_decode

    verifier = DeepseekV3Verifier(model)            # model: transformers.DeepseekV3ForCausalLM
    result = speculative_decode(verifier, prompts, 64, drafter=lookup_tree)

A layer above the runtime: it uses `mlagen.verify_attention` (or `mlagen.reference` on the CPU)
and nothing below imports it. transformers is not imported here: the verifier takes a model
object, so `import mlagen.integrations` works without transformers installed.

Modules, one job each: `paged_cache` (pages, block tables, append and keep), `backends` (the
attention: the op or the reference), `deepseek_v3` (the model's layers with absorbed MLA),
`drafting` (draft trees, prompt lookup, greedy acceptance), `speculative` (the decoding loop).
"""

from .backends import AttentionBackend, MlagenBackend, ReferenceBackend, default_backend
from .deepseek_v3 import AbsorbedMLA, DeepseekV3Verifier, apply_rope, check_model, model_logits
from .drafting import PAD_TOKEN, DraftTree, accept_greedy, lookup_tree, prompt_lookup
from .paged_cache import PagedLatentCache, RowIndex
from .speculative import DecodeResult, VerifyStep, no_draft, speculative_decode

__all__ = [
    "PAD_TOKEN",
    "AbsorbedMLA",
    "AttentionBackend",
    "DecodeResult",
    "DeepseekV3Verifier",
    "DraftTree",
    "MlagenBackend",
    "PagedLatentCache",
    "ReferenceBackend",
    "RowIndex",
    "VerifyStep",
    "accept_greedy",
    "apply_rope",
    "check_model",
    "default_backend",
    "lookup_tree",
    "model_logits",
    "no_draft",
    "prompt_lookup",
    "speculative_decode",
]
