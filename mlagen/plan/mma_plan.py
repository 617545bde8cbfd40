"""Layout rules of the tensor-core family (mma.sync m16n8k16, fp32 accumulation).

A block holds q_tile*head_tile query rows, padded to M_PAD = 16*m_tiles (the mma's M). For the
scores S = Q K^T its warps form a WMQ x WNQ grid over (rows, keys) of each KV tile; for the
output O += P V every warp holds all M_PAD rows and Dl/warps of the value dims, so O stays in
registers (M_PAD * Dl / (32*warps) fp32 per thread). On sm_90a the two warpgroups run both
products on wgmma from shared memory instead: scores for 32 keys each of all 64 rows, output
for Dl/2 dims each. P and the row maxima cross warps through shared memory. Q and KV tiles are
stored in 64-element column blocks of 128-byte rows with the 128-byte XOR swizzle
(chunk ^ row%8): ldmatrix reads 8 rows at one chunk column without bank conflicts, and it is
the layout wgmma's K-major descriptors read. P rows are padded by 16 bytes for ldmatrix, or
take the same swizzle for wgmma.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..dsl.arch import MAX_ACCUMULATORS, accumulator_budget
from ..dsl.kv_layout import row_bytes
from ..dsl.spec import MAX_SEQLEN_Q, Problem, Variant

# block_n values the mma family's layouts accept (keys of a KV tile).
MMA_BLOCK_NS = (32, 64, 128)
# The sm_90a tile: its scores run on wgmma in blocks of WGMMA_TILE (padded rows, warps, keys): two
# warpgroups over 64 rows and 64-key tiles.
WGMMA_ARCHS = ("sm_90a",)
WGMMA_TILE = (64, 8, 64)
# Padding of a staged output row, in values (templates/mma_epilogue.cuh.j2): 8 puts the staging
# stores on 32 distinct banks (fp32: a half-warp's float2 stores, 4 rows x 4 lanes; part16: a
# warp's 4-byte pairs, 8 rows x 4 lanes).
STAGE_PAD = 8


@dataclass(frozen=True)
class MmaLayout:
    m_pad: int            # padded rows per block
    wmq: int              # warps along rows for the scores
    wnq: int              # warps along keys for the scores
    rows_w: int           # score rows per warp
    keys_w: int           # score keys per warp
    dims_w: int           # output dims per warp
    p_stride: int         # elements per row of P in shared memory (padded)
    smem_bytes: int
    wgmma: bool = False   # scores by warpgroup wgmma (sm_90a) instead of mma.sync
    pv_wgmma: bool = False  # the output product too (sm_90a unless the variant says mma_pv)

    @property
    def stage_pad(self) -> int:
        """Padding of a staged output row in the epilogue, in values (STAGE_PAD)."""
        return STAGE_PAD


def _score_split(m_pad: int, block_n: int, warps: int) -> tuple[int, int] | None:
    """The (WMQ, WNQ) grid that reads the least shared memory per mma: min 1/rows + 1/keys."""
    best = None
    for wmq in range(1, warps + 1):
        if warps % wmq:
            continue
        wnq = warps // wmq
        if m_pad % (16 * wmq) or block_n % (16 * wnq):
            continue
        cost = wmq / m_pad + wnq / block_n
        if best is None or cost < best[0]:
            best = (cost, wmq, wnq)
    return None if best is None else (best[1], best[2])


# The transposed tile: its N = rows in multiples of 8, at most what leaves
# two 64-key stages and P^T's 1 KB blocks room in sm_90a's 227 KB (templates/mma_transposed.cu.j2).
TRANSPOSED_ROWS = range(16, 73, 8)
KV_COLUMN_BLOCK = 64 * 128          # bytes of a 64-key tile's 64-dim column block


def transposed_layout(p: Problem, v: Variant) -> MmaLayout | str:
    """The transposed tile's layout, or what it needs beyond its schedule's rules
    (`schedules.SCHEDULES`): Q [rows][576], two stages of 64 keys, and two 1 KB blocks (P^T's
    ninth column group and the running max between the warpgroups; its stages' mbarriers live in
    them with TMA loads)."""
    rows = v.q_tile * v.head_tile
    if rows not in TRANSPOSED_ROWS:
        return f"q_tile*head_tile a multiple of 8 from 16 to 72 for transposed, got {rows}"
    if (p.dl, p.dr) != (512, 64):
        return f"Dl=512 and Dr=64 for transposed (P^T lives in the rope block), got Dl={p.dl} Dr={p.dr}"
    smem = rows * p.head_dim * 2 + 2 * 9 * KV_COLUMN_BLOCK + 2 * 1024
    return MmaLayout(m_pad=rows, wmq=4, wnq=2, rows_w=rows, keys_w=64, dims_w=p.dl // 2, p_stride=64,
                     smem_bytes=smem, wgmma=True, pv_wgmma=True)


# The KV cache as TMA loads read it (Variant.loads "tma"): boxes of TMA_BOX_DIMS dims, one
# 128-byte swizzled column block of 16-bit values, described by a CUtensorMap of
# TENSOR_MAP_BYTES (the runtime's mlagen/runtime/tensormap.py and the C++ launcher encode it).
TMA_BOX_DIMS = 64
TENSOR_MAP_BYTES = 128

# Stack that a transposed tile of more than 32 rows may take: its 144 output accumulators (72
# rows) fill the registers, and ptxas spills a few dozen bytes (more with a tree mask's byte
# reads; docs/design.md, "Transposed tile"). More means something grew.
TRANSPOSED_STACK = 128


def no_stack(v: Variant) -> int:
    """The stack (spills) a kernel that keeps everything in registers may take: none."""
    return 0


def transposed_stack(v: Variant) -> int:
    """The stack a transposed tile may take: TRANSPOSED_STACK for more than 32 rows, else none."""
    return TRANSPOSED_STACK if v.q_tile * v.head_tile > 32 else 0


# The seesaw's mbarriers: its tile pair loads in SEESAW_LOAD_PARTS parts, each with one (stage
# 0's value-left blocks and the rest, stage 1's value-right blocks and the rest, each refilled
# by the warpgroup that reads it last), and each of the two warpgroups hands its P and row
# maxima over on one.
SEESAW_LOAD_PARTS = 4
SEESAW_BARRIERS = SEESAW_LOAD_PARTS + 2
# The fp8_ws schedule (templates/mma_ws_producer.cuh.j2): a producer warpgroup beside the seesaw's
# two. Its mbarriers take the seesaw's four load parts' places as each stage's "free" (both
# warpgroups' reads done) and "front widened" (the 16-bit tile's first blocks ready) hand-offs,
# keep the P hand-offs, and add two a stage: "landed" (its TMA boxes' bytes) and "back widened".
# The fp8_mma schedule keeps the same mbarriers, "front" as a stage's "empty" and "back" as its
# value copy's "written" (templates/mma_ws_producer.cuh.j2).
FP8_WS_PRODUCER_WARPS = 4
FP8_WS_STAGES = 2
FP8_WS_BARRIERS = SEESAW_BARRIERS + 2 * FP8_WS_STAGES


# The P exchange (templates/mma_exchange.cu.j2): a block's slot holds its
# tile's P (64 rows x 64 keys, 16-bit, 1024-byte aligned for wgmma) and the rows' sums; the rows'
# maxima go first, in slots of 64 floats.
EXCHANGE_SLOT = 9 * 1024
EXCHANGE_MAX_SLOT = 64 * 4
# The rows a P exchange block holds: those of one m64 wgmma row group, 49 to 64.
EXCHANGE_ROWS = range(49, 65)


def no_mbarriers(v: Variant) -> int:
    """mbarriers of a kernel that keeps none after its tree-mask rows (the transposed tile keeps
    its stages' inside its 1 KB blocks)."""
    return 0


def stage_mbarriers(v: Variant) -> int:
    """The lockstep loop's mbarriers: one per stage with TMA loads, each counting a tile's bytes;
    none with cp.async copies."""
    return v.stages if v.loads == "tma" else 0


def seesaw_mbarriers(v: Variant) -> int:
    """The seesaw's mbarriers: SEESAW_BARRIERS."""
    return SEESAW_BARRIERS


def seesaw_load_mbarriers(v: Variant) -> int:
    """Those of the seesaw's mbarriers that count KV bytes landing: one a load part
    (SEESAW_LOAD_PARTS); its others count a warpgroup's arrivals."""
    return SEESAW_LOAD_PARTS


def ws_mbarriers(v: Variant) -> int:
    """The fp8_ws and fp8_mma schedules' mbarriers: FP8_WS_BARRIERS."""
    return FP8_WS_BARRIERS


def ws_landing_mbarriers(v: Variant) -> int:
    """Those of the fp8_ws and fp8_mma schedules' mbarriers that count a TMA load's bytes: one a
    stage."""
    return FP8_WS_STAGES


def exchange_mbarriers(v: Variant) -> int:
    """The P exchange's mbarriers: one for the cluster's row maxima and one a slot (its peers'
    bulk copies, none a KV load)."""
    return 1 + int(v.kv_split)


def exchange_units(p: Problem, cluster: int) -> int:
    """The most 64-dim column blocks of the value dims one block of the cluster adds up
    (block r owns blocks r, r + cluster, ...)."""
    return -(-(p.dl // 64) // cluster)


def exchange_layout(p: Problem, v: Variant) -> MmaLayout | str:
    """The P exchange's layout, or what it needs beyond its schedule's rules
    (`schedules.SCHEDULES`): Q (its buffer later holds the cluster's slots), the block's own
    tile, the value slices of the other tiles for its column blocks, the cluster's row maxima,
    the row max / sum parts and the tree-mask rows (its mbarriers follow: `TileSchedule.block_layout`)."""
    rows = v.q_tile * v.head_tile
    if rows not in EXCHANGE_ROWS:
        return (f"q_tile*head_tile from {EXCHANGE_ROWS[0]} to {EXCHANGE_ROWS[-1]} for p_exchange (one m64 wgmma row "
                f"group), got {rows}")
    if p.head_dim % 64 or p.dl % 64:
        return f"Dl and Dl+Dr multiples of 64 for p_exchange (64-dim column blocks), got Dl={p.dl} Dr={p.dr}"
    k = int(v.kv_split)
    tile = 64 * p.head_dim * 2
    slices = exchange_units(p, k) * (k - 1) * KV_COLUMN_BLOCK
    smem = max(tile, k * EXCHANGE_SLOT) + tile + slices + k * EXCHANGE_MAX_SLOT + 4 * 64 * 4 + MAX_SEQLEN_Q * 8
    return MmaLayout(m_pad=64, wmq=4, wnq=2, rows_w=16, keys_w=32, dims_w=64, p_stride=64,
                     smem_bytes=smem, wgmma=True, pv_wgmma=True)


MMA_M = 16      # rows of one mma.sync fragment: a block's query rows pad to a multiple of it


def padded_rows(rows: int) -> int:
    """A block's `rows` query rows padded to whole mma fragments (M_PAD)."""
    return -(-rows // MMA_M) * MMA_M


def fp8_staging_bytes(p: Problem, v: Variant) -> int:
    """Shared memory of an FP8 cache's staged rows: `v.stages` tiles of block_n rows as the cache
    holds them, rounded up to 1024 bytes (P after them is a wgmma operand); 0 for 16-bit caches."""
    if not p.fp8_kv:
        return 0
    return -(-v.stages * v.block_n * row_bytes(p.kv_format, p.head_dim, 2) // 1024) * 1024


def kv_stage_bytes(p: Problem, v: Variant) -> int:
    """Shared memory of the lockstep loop's KV tiles: `v.stages` 16-bit tiles; with an FP8 cache
    one 16-bit tile (the staged rows dequantized) and the staged rows (`fp8_staging_bytes`)."""
    tile = v.block_n * p.head_dim * 2
    return tile + fp8_staging_bytes(p, v) if p.fp8_kv else v.stages * tile


def widened_layout(p: Problem, v: Variant) -> MmaLayout | str:
    """The fp8_ws schedule's layout: the seesaw's, two 16-bit stages and no staged rows, as an FP8
    tile lands in the back of the stage it widens into (templates/mma_ws_producer.cuh.j2)."""
    return lockstep_layout(p.with_(kv_format="dtype"), v)


def ldg_layout(p: Problem, v: Variant) -> MmaLayout | str:
    """The fp8_ldg schedule's layout: fp8_ws's (`widened_layout`: the seesaw's two 16-bit stages, no
    staged rows), and over gathered keys a 64-bit word a stage after the mbarriers, the bits of the
    rows its producer filled from listed rows (templates/mma_fp8_ldg.cuh.j2)."""
    layout = widened_layout(p, v)
    if isinstance(layout, str) or not p.gathered:
        return layout
    return replace(layout, smem_bytes=layout.smem_bytes + 8 * v.stages)


# The fp8_mma schedule keeps Q and its KV stages as e4m3 bytes in 128-byte column blocks of the
# same swizzle (a 576-byte row fills four blocks and half of a fifth, the rope's), and beside each
# stage the key-major copy of its value dims that P·V reads (BN bytes a value dim).
FP8_BLOCK_BYTES = 128


def fp8_row_bytes(p: Problem) -> int:
    """Bytes of a Q or KV row of e4m3 values in the fp8_mma schedule's column blocks: head_dim
    rounded up to whole 128-byte blocks."""
    return -(-p.head_dim // FP8_BLOCK_BYTES) * FP8_BLOCK_BYTES


def fp8_products_layout(p: Problem, v: Variant) -> MmaLayout | str:
    """The fp8_mma schedule's layout: the seesaw's (`widened_layout`), its 16-bit Q and stages
    replaced by Q and `v.stages` KV stages of e4m3 bytes (`fp8_row_bytes` a row) and one
    key-major value copy a stage (Dl x block_n bytes); P's place holds P0 and P1 in e4m3."""
    layout = widened_layout(p, v)
    if isinstance(layout, str):
        return layout
    row = fp8_row_bytes(p)
    widened = layout.m_pad * p.head_dim * 2 + kv_stage_bytes(p.with_(kv_format="dtype"), v)
    e4m3 = layout.m_pad * row + v.stages * v.block_n * (row + p.dl)
    return replace(layout, smem_bytes=layout.smem_bytes - widened + e4m3)


def lockstep_layout(p: Problem, v: Variant) -> MmaLayout | str:
    """The layout of the lockstep tile loop (templates/mma.cu.j2), which the seesaw shares, or a
    message saying which rule the variant breaks; the schedule's mbarriers follow its tree-mask
    rows (`TileSchedule.block_layout`)."""
    rows = v.q_tile * v.head_tile
    m_pad = padded_rows(rows)
    if p.head_dim % 64:
        return f"Dl+Dr a multiple of 64 for the mma family (the swizzle spans 8 chunks), got {p.head_dim}"
    if v.block_n not in MMA_BLOCK_NS:
        return f"block_n one of {MMA_BLOCK_NS} for the mma family, got {v.block_n}"
    if p.dl % (16 * v.warps):
        return f"Dl={p.dl} divisible by 16*warps={16 * v.warps} (each warp owns 16-dim output slabs)"
    dims_w = p.dl // v.warps
    o_regs = m_pad * dims_w // 32
    o_max = accumulator_budget(v.warps)
    if o_regs > o_max:
        return (f"at most {o_max} output accumulators per thread with {v.warps} warps; {m_pad} padded "
                f"rows x {dims_w} dims / 32 lanes = {o_regs}: use fewer rows"
                + (" or more warps" if o_max == MAX_ACCUMULATORS else ""))
    wgmma = v.arch in WGMMA_ARCHS
    if v.mma_pv and not wgmma:
        return f"mma_pv only on sm_90a (elsewhere P·V runs on mma.sync anyway), got arch {v.arch}"
    if wgmma and (m_pad, v.warps, v.block_n) != WGMMA_TILE:
        return (f"on sm_90a the scores run on wgmma (m64n32k16 per warpgroup) in 64-row, 64-key "
                f"blocks of two warpgroups: 64 padded rows, 8 warps and block_n=64, got {m_pad} rows, "
                f"{v.warps} warps, block_n={v.block_n}")
    # wgmma: each warpgroup takes 32 keys of all 64 rows, its warps 16 rows each.
    split = (4, 2) if wgmma else _score_split(m_pad, v.block_n, v.warps)
    if split is None:
        return (f"warps={v.warps} that tile {m_pad} rows x block_n={v.block_n} keys in 16x16 "
                "pieces for the scores")
    wmq, wnq = split
    p_stride = v.block_n + 8
    # Q, the KV stages, P, the row max / sum parts, the running max and the tree-mask rows.
    smem = (m_pad * p.head_dim * 2 + kv_stage_bytes(p, v) + m_pad * p_stride * 2
            + wnq * m_pad * 4 + m_pad * 4 + MAX_SEQLEN_Q * 8)
    return MmaLayout(m_pad=m_pad, wmq=wmq, wnq=wnq, rows_w=m_pad // wmq, keys_w=v.block_n // wnq,
                     dims_w=dims_w, p_stride=p_stride, smem_bytes=smem, wgmma=wgmma,
                     pv_wgmma=wgmma and not v.mma_pv)
