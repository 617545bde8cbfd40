"""The byte layout of a cached MLA row in each FP8 format: the one place its numbers live (the
plan renders them into the kernels; `mlagen.runtime.kv_formats` quantizes and dequantizes with
them). docs/design.md, "FP8 KV caches", describes the formats.
"""

from __future__ import annotations

LATENT_DIM = 512                                # Dl: the latent dims, also the value row
ROPE_DIM = 64                                   # Dr
ROW_DIM = LATENT_DIM + ROPE_DIM                 # 576
E4M3_BYTES = 1                                  # a float8_e4m3fn value
GROUP_DIM = 128                                 # latent dims per ds_mla scale
GROUPS = LATENT_DIM // GROUP_DIM                # 4 scales a row
SCALE_BYTES = 4                                 # a ds_mla group scale: fp32, little-endian
ROPE_VALUE_BYTES = 2                            # a ds_mla rope dim: bf16
SCALES_AT = LATENT_DIM * E4M3_BYTES             # byte 512: the group scales
ROPE_AT = SCALES_AT + GROUPS * SCALE_BYTES      # byte 528: the rope dims
DS_MLA_ROW_BYTES = ROPE_AT + ROPE_DIM * ROPE_VALUE_BYTES   # 656


def row_bytes(kv_format: str, head_dim: int, elem_bytes: int) -> int:
    """Bytes of one cached row in `kv_format`: head_dim values of elem_bytes each for "dtype" (the
    16-bit caches), head_dim e4m3 values for "e4m3", DS_MLA_ROW_BYTES for "ds_mla"."""
    if kv_format == "ds_mla":
        return DS_MLA_ROW_BYTES
    return head_dim * (E4M3_BYTES if kv_format == "e4m3" else elem_bytes)
