"""The kernel parameter block: one field list renders the C struct and packs the host bytes.

Every kernel takes `const VerifyParams p` by value. Keeping the list here, once, means the
struct in the generated source, the bytes the runtime launches with and the C++ launcher of
`mlagen emit --launcher` cannot drift apart. Fields are ordered so that the C layout has no
padding and `struct.pack` reproduces it exactly: the pointers, the 8-byte fields, the 4-byte ones
(an even count) and one 8-byte field after them. A new field goes to the end of its group, 16
bytes at a time where it can, so that the fields before it keep their offsets modulo 16: ptxas
pairs neighbouring fields into wide constant loads by those offsets, and the kernels' code stays
as it was.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str      # C type in the struct
    fmt: str        # struct-module code: Q pointer, q int64, i int32, f float32
    doc: str


FIELDS: tuple[Field, ...] = (
    Field("q", "const q_t*", "Q", "(B, S, H, Dl+Dr) in the problem's q_format, last dim contiguous"),
    Field("kv", "const kv_t*", "Q", "(num_pages, page_size, row) cached rows in the problem's kv_format, last dim "
          "contiguous"),
    Field("kv_map", "const void*", "Q", "device address of kv's TMA descriptor (tma variants), else 0"),
    Field("block_table", "const int*", "Q", "(B, max_pages) page ids of each request, in order"),
    Field("seqlens", "const int*", "Q", "(B,) valid keys per request, draft tokens included"),
    Field("tree_mask", "const unsigned char*", "Q", "(B or 1, S, S) bool, tree mask kind only"),
    Field("q_counts", "const int*", "Q", "(B,) ragged rows (Variant.rows 'ragged'): request b's real query rows "
          "are its last q_counts[b], the rows before them padding; null: all S rows are real"),
    Field("out", "elem_t*", "Q", "(B, S, H, Dl)"),
    Field("lse", "float*", "Q", "(B, H, S) fp32, natural log; written when the problem has lse"),
    Field("part_o", "void*", "Q", "(num_splits, B, S, H, Dl) partial outputs: fp32 unnormalized, "
          "or normalized in elem_t (part16)"),
    Field("part_ml", "float2*", "Q", "(num_splits, B, S, H) partial (max, sum), log2 domain"),
    Field("counters", "unsigned int*", "Q", "(row groups,) finished splits per row group; zero between calls"),
    Field("kv_scale_ptr", "const float*", "Q", "e4m3 caches: the one fp32 kv_scale on the device, or null for "
          "the kv_scale field"),
    Field("q_scale_ptr", "const float*", "Q", "e4m3 queries: the one fp32 q_scale on the device, or null "
          "(a host q_scale is folded into scale_log2)"),
    Field("indices", "const int*", "Q", "(B, S, topk) gathered keys (Problem.keys 'gathered'): the flat cache row "
          "ids, page x page_size + offset, each query token attends to; -1 an unused slot"),
    Field("topk_length", "const int*", "Q", "(B,) gathered keys: request b's tokens use their first topk_length[b] "
          "slots; null: all topk"),
    Field("q_stride_b", "long long", "q", "elements between requests of q"),
    Field("q_stride_s", "long long", "q", "elements between query positions of q"),
    Field("q_stride_h", "long long", "q", "elements between heads of q"),
    Field("kv_stride_page", "long long", "q", "elements between pages of kv"),
    Field("kv_stride_row", "long long", "q", "elements between rows of a page"),
    Field("bt_stride_b", "long long", "q", "elements between rows of block_table"),
    Field("mask_stride_b", "long long", "q", "elements between requests of tree_mask (0: shared)"),
    Field("mask_stride_q", "long long", "q", "elements between query rows of tree_mask"),
    Field("out_stride_b", "long long", "q", "elements between requests of out"),
    Field("out_stride_s", "long long", "q", "elements between query positions of out"),
    Field("out_stride_h", "long long", "q", "elements between heads of out"),
    Field("idx_stride_b", "long long", "q", "elements between requests of indices"),
    Field("idx_stride_s", "long long", "q", "elements between query tokens of indices"),
    Field("batch", "int", "i", "B"),
    Field("seqlen_q", "int", "i", "S, draft tokens per request"),
    Field("max_pages", "int", "i", "columns of block_table"),
    Field("num_pages", "int", "i", "pages in kv; page ids outside [0, num_pages) read as zeros"),
    Field("num_splits", "int", "i", "key-range splits; 1 writes out directly, no merge blocks"),
    Field("merge_blocks", "int", "i", "merge blocks per row group (num_splits > 1), in z slabs >= batch"),
    Field("split_keys_log2", "int", "i", "batch-invariant mode (fixed and adaptive splits): a row group's keys go "
          "to the fewest of its num_splits splits that hold at most 2^split_keys_log2 keys each, counted from "
          "its own length; 0: all num_splits"),
    Field("scale_log2", "float", "f", "softmax_scale * log2(e)"),
    Field("kv_scale", "float", "f", "e4m3 caches: real value = stored value * kv_scale (when kv_scale_ptr is null)"),
    Field("dependent", "int", "i", "1: launched as a programmatic dependent (the P exchange then prefetches "
          "before its griddepcontrol.wait), 0: plainly"),
    Field("topk", "long long", "q", "slots per query token in indices (gathered keys), else 0"),
)

_FORMAT = "<" + "".join(f.fmt for f in FIELDS)
PARAMS_SIZE = struct.calcsize(_FORMAT)
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
# The pointers change on every call; the rest (strides, sizes, splits, scale) is fixed by the
# arguments' metadata, so the runtime gathers it once per argument signature.
POINTER_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS if f.fmt == "Q")
TAIL_NAMES: tuple[str, ...] = FIELD_NAMES[len(POINTER_NAMES):]
_STRUCT = struct.Struct(_FORMAT)

assert PARAMS_SIZE % 8 == 0, PARAMS_SIZE  # no tail padding: C and struct agree
assert FIELD_NAMES[:len(POINTER_NAMES)] == POINTER_NAMES, "pointers must lead the struct"


def tail(values: dict[str, int | float]) -> tuple[int | float, ...]:
    """The fields after the pointers, in struct order, from `values` (one entry per name)."""
    missing = set(TAIL_NAMES) - set(values)
    if missing:
        raise KeyError(f"parameter block is missing {sorted(missing)}")
    return tuple(values[name] for name in TAIL_NAMES)


# pointers({"q": ..., "kv": ..., ...}): the pointer fields' values (ints, 0 for none) in
# POINTER_NAMES order, from a dict keyed by every pointer field's name (KeyError for a missing
# one). The runtime names each pointer it passes, so the struct's order is this list's alone.
pointers: Callable[[dict[str, int]], tuple[int, ...]] = operator.itemgetter(*POINTER_NAMES)

# Byte offset of `dependent`, which `launch` sets on the packed block of a dependent launch.
DEPENDENT_OFFSET = struct.calcsize("<" + "".join(f.fmt for f in FIELDS[:FIELD_NAMES.index("dependent")]))

# pack_into(buffer, 0, *pointer_values, *rest): the struct into `buffer` (PARAMS_SIZE writable
# bytes), the pointers as `pointers` returns them, then `rest` as `tail` returns it. It runs once
# per launch, so it is the struct's own method: no Python frame around it.
pack_into = _STRUCT.pack_into
