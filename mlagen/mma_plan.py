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

from dataclasses import dataclass

from .arch import MAX_ACCUMULATORS, Arch, accumulator_budget
from .spec import Problem, Variant, kernel_name

BLOCK_NS = (32, 64, 128)
# Padding of a staged output row, in values (templates/mma.cu.j2's epilogue): 8 puts the staging
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


# The transposed tile (Variant.transposed): its N = rows in multiples of 8, at most what leaves
# two 64-key stages and P^T's 1 KB blocks room in sm_90a's 227 KB (templates/mma_transposed.cu.j2).
TRANSPOSED_ROWS = range(16, 73, 8)
KV_COLUMN_BLOCK = 64 * 128          # bytes of a 64-key tile's 64-dim column block


def transposed_layout(p: Problem, v: Variant) -> MmaLayout | str:
    """The transposed tile's layout, or what it needs: Q [rows][576], two stages of 64 keys, and
    two 1 KB blocks (P^T's ninth column group and the running max between the warpgroups)."""
    rows = v.q_tile * v.head_tile
    if v.arch != "sm_90a":
        return f"arch sm_90a for transposed (wgmma), got {v.arch}"
    if rows not in TRANSPOSED_ROWS:
        return f"q_tile*head_tile a multiple of 8 from 16 to 72 for transposed, got {rows}"
    if (p.dl, p.dr) != (512, 64):
        return f"Dl=512 and Dr=64 for transposed (P^T lives in the rope block), got Dl={p.dl} Dr={p.dr}"
    if (v.block_n, v.warps, v.stages) != (64, 8, 2):
        return (f"block_n=64, 8 warps and 2 stages for transposed, got block_n={v.block_n}, {v.warps} warps, "
                f"{v.stages} stages")
    if v.seesaw or v.cluster or v.mma_pv:
        return "no seesaw, cluster or mma_pv with transposed (its own schedule)"
    smem = rows * p.head_dim * 2 + 2 * 9 * KV_COLUMN_BLOCK + 2 * 1024
    return MmaLayout(m_pad=rows, wmq=4, wnq=2, rows_w=rows, keys_w=64, dims_w=p.dl // 2, p_stride=64,
                     smem_bytes=smem, wgmma=True, pv_wgmma=True)


# Stack that a transposed tile of more than 32 rows may take: its 144 output accumulators (72
# rows) fill the registers, and ptxas spills 40-56 bytes (88-96 with a tree mask's byte reads),
# as in the kernels timed on the H200 (docs/design.md, "Transposed tile"). More means something
# grew.
TRANSPOSED_STACK = 128


def stack_budget(v: Variant) -> int:
    """Bytes of stack (spills) `v`'s kernels may take: 0, but for a transposed tile of more than
    32 rows TRANSPOSED_STACK."""
    return TRANSPOSED_STACK if v.transposed and v.q_tile * v.head_tile > 32 else 0


# The seesaw's mbarriers: its tile pair loads in four parts, each with one (stage 0's
# value-left blocks and the rest, stage 1's value-right blocks and the rest, each refilled by
# the warpgroup that reads it last), and each warpgroup hands its P and row maxima over on one.
SEESAW_BARRIERS = 6


# The P exchange (Variant.p_exchange, templates/mma_exchange.cu.j2): a block's slot holds its
# tile's P (64 rows x 64 keys, 16-bit, 1024-byte aligned for wgmma) and the rows' sums; the rows'
# maxima go first, in slots of 64 floats.
EXCHANGE_SLOT = 9 * 1024
EXCHANGE_MAX_SLOT = 64 * 4


def exchange_units(p: Problem, cluster: int) -> int:
    """The most 64-dim column blocks of the value dims one block of the cluster adds up
    (block r owns blocks r, r + cluster, ...)."""
    return -(-(p.dl // 64) // cluster)


def exchange_layout(p: Problem, v: Variant) -> MmaLayout | str:
    """The P exchange's layout, or what it needs: Q (its buffer later holds the cluster's
    slots), the block's own tile, the value slices of the other tiles for its column blocks, the
    cluster's row maxima, the row max / sum parts, the tree-mask rows and mbarriers (the maxima's,
    one a slot)."""
    rows = v.q_tile * v.head_tile
    if v.arch != "sm_90a":
        return f"arch sm_90a for p_exchange (wgmma, bulk copies between a cluster's blocks), got {v.arch}"
    if not v.cluster:
        return "cluster=True with p_exchange (the blocks that exchange P are one cluster)"
    if not 49 <= rows <= 64:
        return f"q_tile*head_tile from 49 to 64 for p_exchange (one m64 wgmma row group), got {rows}"
    if (v.block_n, v.warps, v.stages) != (64, 8, 1):
        return (f"block_n=64, 8 warps and 1 stage for p_exchange (one tile a block), got block_n={v.block_n}, "
                f"{v.warps} warps, {v.stages} stages")
    if v.tma or v.seesaw or v.transposed or v.mma_pv or v.part16:
        return "no tma, seesaw, transposed, mma_pv or part16 with p_exchange (its own schedule, no partials)"
    if p.head_dim % 64 or p.dl % 64:
        return f"Dl and Dl+Dr multiples of 64 for p_exchange (64-dim column blocks), got Dl={p.dl} Dr={p.dr}"
    k = int(v.kv_split)
    tile = 64 * p.head_dim * 2
    slices = exchange_units(p, k) * (k - 1) * KV_COLUMN_BLOCK
    smem = (max(tile, k * EXCHANGE_SLOT) + tile + slices + k * EXCHANGE_MAX_SLOT + 4 * 64 * 4 + 64 * 8
            + 8 + k * 8)
    return MmaLayout(m_pad=64, wmq=4, wnq=2, rows_w=16, keys_w=32, dims_w=64, p_stride=64,
                     smem_bytes=smem, wgmma=True, pv_wgmma=True)


def mma_layout(p: Problem, v: Variant) -> MmaLayout | str:
    """The layout, or a message saying which rule the variant breaks."""
    if v.transposed:
        return transposed_layout(p, v)
    if v.p_exchange:
        return exchange_layout(p, v)
    rows = v.q_tile * v.head_tile
    m_pad = -(-rows // 16) * 16
    if p.head_dim % 64:
        return f"Dl+Dr a multiple of 64 for the mma family (the swizzle spans 8 chunks), got {p.head_dim}"
    if v.block_n not in BLOCK_NS:
        return f"block_n one of {BLOCK_NS} for the mma family, got {v.block_n}"
    if p.dl % (16 * v.warps):
        return f"Dl={p.dl} divisible by 16*warps={16 * v.warps} (each warp owns 16-dim output slabs)"
    dims_w = p.dl // v.warps
    o_regs = m_pad * dims_w // 32
    o_max = accumulator_budget(v.warps)
    if o_regs > o_max:
        return (f"at most {o_max} output accumulators per thread with {v.warps} warps; {m_pad} padded "
                f"rows x {dims_w} dims / 32 lanes = {o_regs}: use fewer rows"
                + (" or more warps" if o_max == MAX_ACCUMULATORS else ""))
    wgmma = v.arch == "sm_90a"
    if v.mma_pv and not wgmma:
        return f"mma_pv only on sm_90a (elsewhere P·V runs on mma.sync anyway), got arch {v.arch}"
    if wgmma and (m_pad, v.warps, v.block_n) != (64, 8, 64):
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
    # Q, the KV stages, P, the row max / sum parts, the running max, the tree-mask rows, and with
    # tma one mbarrier per stage, or with seesaw one per part of a tile pair (in the dynamic
    # block: a static one would be padded to the dynamic block's 1024-byte alignment).
    barriers = SEESAW_BARRIERS if v.seesaw else v.stages if v.tma else 0
    smem = (m_pad * p.head_dim * 2 + v.stages * v.block_n * p.head_dim * 2 + m_pad * p_stride * 2
            + wnq * m_pad * 4 + m_pad * 4 + 64 * 8 + barriers * 8)
    return MmaLayout(m_pad=m_pad, wmq=wmq, wnq=wnq, rows_w=m_pad // wmq, keys_w=v.block_n // wnq,
                     dims_w=dims_w, p_stride=p_stride, smem_bytes=smem, wgmma=wgmma,
                     pv_wgmma=wgmma and not v.mma_pv)


def plan_mma(p: Problem, v: Variant, arch: Arch):
    from .errors import SpecError, require, require_smem
    from .validate import KernelPlan

    if not arch.mma:
        raise SpecError("variant.arch", arch.name, "an arch with mma.sync bf16/fp16 (sm_80 or newer)")
    layout = mma_layout(p, v)
    if isinstance(layout, str):
        raise SpecError("variant", v.name, layout)
    require_smem(arch, layout.smem_bytes, v.name)
    if v.tma:
        require(layout.wgmma, "variant.tma", v.tma, f"False on {arch.name}: TMA tile loads are for sm_90a's kernels")
        require(p.page_size % v.block_n == 0, "variant.tma", v.tma,
                f"False for page_size={p.page_size}: a TMA tile is one page's run of block_n={v.block_n} rows")
    if v.seesaw:
        require(v.tma and layout.pv_wgmma and v.stages == 2 and not v.cluster, "variant.seesaw", v.seesaw,
                "False, or True on sm_90a with tma, both products on wgmma (no mma_pv), two stages and no cluster")
    if v.cluster and not v.p_exchange:      # the P exchange stages no output rows
        require(arch.capability >= 90, "variant.cluster", v.cluster,
                f"False on {arch.name}: thread-block clusters need sm_90 or newer")
        # The cluster's blocks stage their output rows (fp32, or 16-bit with part16) over the Q
        # and KV buffers (the template's STAGE_EPILOGUE, which static_asserts the same sum) for
        # their peers to read.
        staged = layout.m_pad * (p.dl + STAGE_PAD) * (2 if v.part16 else 4)
        buffers = (layout.m_pad + v.stages * v.block_n) * p.head_dim * 2
        require(staged <= buffers, "variant.cluster", v.cluster,
                f"False for this tile: the {staged} bytes of staged output rows need Q and KV "
                f"buffers that large, these have {buffers} (more stages or a wider KV tile)")
    return KernelPlan(
        problem=p, variant=v, arch=arch, name=kernel_name(p, v), threads=v.warps * 32,
        rows=v.q_tile * v.head_tile, rows_pad=layout.m_pad, rows_per_warp=layout.rows_w,
        head_tiles=p.heads // v.head_tile, row_elems=p.head_dim, smem_bytes=layout.smem_bytes,
        mma=layout,
    )


# Heuristic tile choice: a block's KV stream costs about as much as this many rows of mma work
# (per key, a block reads 1152 bytes and each row does 2*1088 flops).
ROW_COST_OF_A_BLOCK = 24
MAX_ROWS = 64
# sm_90a's wgmma scores run rows 1.25-1.45x faster than mma.sync on the H200 (H=64 S=9 at 65536
# keys: 345 µs against 453).
WGMMA_COST = 0.75


def _tile_shapes(heads: int, seqlen_q: int) -> list[tuple[int, int, int]]:
    """(cost, q_tile, head_tile) of the tiles holding at most MAX_ROWS rows, cheapest first:
    padded rows plus ROW_COST_OF_A_BLOCK per block (each block streams the KV once)."""
    shapes = []
    for head_tile in (d for d in range(1, heads + 1) if heads % d == 0):
        for q_tile in range(1, min(seqlen_q, MAX_ROWS // head_tile) + 1):
            blocks = -(-seqlen_q // q_tile) * (heads // head_tile)
            padded = blocks * (-(-(q_tile * head_tile) // 16) * 16)
            shapes.append((padded + ROW_COST_OF_A_BLOCK * blocks, -q_tile * head_tile, q_tile, head_tile))
    return [(cost, q, h) for cost, _, q, h in sorted(shapes)]


def _fitting(problem: Problem, q_tile: int, head_tile: int, arch: str) -> Variant | None:
    """The widest KV tile and deepest pipeline that fit `arch` for this tile shape, or None.
    On sm_90a the splits exchange 16-bit partial rows (`part16`: on the H200 1.5-2.8 µs less on
    short split rows, batched rows within noise)."""
    from .errors import SpecError
    from .validate import validate

    m_pad = -(-(q_tile * head_tile) // 16) * 16
    for block_n, stages in ((64, 2), (32, 3), (32, 2), (64, 1), (32, 1)):
        v = Variant(family="mma", head_tile=head_tile, q_tile=q_tile, kv_split="adaptive",
                    block_n=block_n, warps=max(4, m_pad // 8), stages=stages, arch=arch,
                    part16=arch == "sm_90a")
        try:
            validate(problem, v)
            return v
        except SpecError:
            continue
    return None


def heuristic_mma(problem: Problem, seqlen_q: int, arch: str, specialize: bool = True) -> Variant | None:
    """The mma variant for `problem` at S=seqlen_q on a device of target `arch`, or None.

    Per target the device runs (`arch`, and with `specialize` sm_90a on Hopper), the cheapest
    tile shape of `_tile_shapes` that some variant fits; across targets, wgmma's measured
    speed-up weighs in.
    """
    from .arch import specializations

    best: tuple[float, Variant] | None = None
    shapes = _tile_shapes(problem.heads, seqlen_q)
    for target in (arch, *(specializations(arch) if specialize else ())):
        weight = WGMMA_COST if target == "sm_90a" else 1.0
        for cost, q_tile, head_tile in shapes:
            v = _fitting(problem, q_tile, head_tile, target)
            if v is not None:
                if best is None or cost * weight < best[0]:
                    best = (cost * weight, v)
                break
    return None if best is None else best[1]
