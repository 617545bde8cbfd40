"""The op's entry points repeat the same keyword arguments; their defaults must agree."""

import inspect

import mlagen
from mlagen.runtime.reference import reference

SHARED = ("softmax_scale", "causal", "tree_mask", "return_lse", "variant", "head_dim_v")


def _defaults(fn) -> dict:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_shared_keyword_defaults_agree():
    base = _defaults(mlagen.verify_attention)
    for fn in (mlagen.verify_attention_op, mlagen.verify_attention_varlen, mlagen.verify_attention_cp_shard,
               mlagen.verify_attention_varlen_cp_shard, reference):
        other = _defaults(fn)
        for name in SHARED:
            if name in other:
                assert other[name] == base[name], f"{fn.__name__}.{name}: {other[name]!r} != {base[name]!r}"
    assert all(name in base for name in SHARED)
