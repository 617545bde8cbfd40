"""The op's entry points repeat the same keyword arguments; their defaults must agree, and their
typed overloads take all of them. The FP8 cache functions' signatures are pinned, and their scales
default to None wherever they appear."""

import inspect
import typing

import typing_extensions

import mlagen
from mlagen.runtime.op import BatchOptions, VerifyOptions, verify_attention
from mlagen.runtime.reference import gather_kv, reference, reference_naive
from mlagen.runtime.varlen import verify_attention_varlen

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


FP8_SIGNATURES = {
    mlagen.quantize_kv: "(kv_cache, layout='e4m3', kv_scale=None)",
    mlagen.dequantize_kv: "(kv_cache, layout, kv_scale=None, dtype=torch.float32)",
    mlagen.kv_format_of: "(kv_cache, kv_scale=None, *, check_values=False)",
}


def _bare(fn) -> str:
    """The signature without annotations."""
    return str(inspect.signature(fn).replace(
        parameters=[p.replace(annotation=p.empty) for p in inspect.signature(fn).parameters.values()],
        return_annotation=inspect.Signature.empty))


def test_fp8_signatures():
    for fn, expected in FP8_SIGNATURES.items():
        assert _bare(fn) == expected, fn.__name__
    for fn in (*FP8_SIGNATURES, reference, reference_naive, gather_kv):
        defaults = _defaults(fn)
        for name in ("kv_scale", "q_scale"):
            if name in inspect.signature(fn).parameters:
                assert defaults[name] is None, f"{fn.__name__}.{name}"
    assert {"kv_scale", "q_scale"} <= set(_defaults(reference)) & set(_defaults(reference_naive))


def _keywords(fn) -> dict:
    """`fn`'s keyword-only parameters and their types."""
    hints = typing.get_type_hints(fn)
    return {n: hints[n] for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}


def test_overload_stubs_take_every_keyword_of_the_implementation():
    """The entry points' typed overloads take their keywords as one TypedDict each (plus
    return_lse, which picks the return type): it names every keyword-only argument of the
    implementation, with the same type."""
    for fn, options in ((verify_attention, BatchOptions), (verify_attention_varlen, VerifyOptions)):
        keywords = _keywords(fn)
        assert keywords.pop("return_lse") is bool
        assert typing.get_type_hints(options) == keywords, fn.__name__
        stubs = [inspect.signature(stub).parameters for stub in typing_extensions.get_overloads(fn)]
        assert sorted(str(stub["return_lse"].annotation) for stub in stubs) == [
            "Literal[False]", "Literal[True]", "bool"], fn.__name__
        assert {str(stub["options"].annotation) for stub in stubs} == {f"Unpack[{options.__name__}]"}, fn.__name__
