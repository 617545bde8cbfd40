"""The DSL: frozen, hashable descriptions of a problem and of a kernel variant.

A `Problem` fixes everything about the tensors that changes the generated code (head count,
latent and rope widths, dtype, page size, mask kind, whether LSE is written). A `Variant` fixes
how the kernel is built (family, tiling, split and how the splits combine, warps, pipeline depth,
target arch, the tile loop's schedule, how KV tiles load, the partials' type). Both are
plain values: `validate.validate(problem, variant)` decides whether the pair can work and
derives every number the templates need.

Every spec has a stable, readable name (`Problem.name`, `Variant.name`): it names kernels,
emitted files, cache manifests and benchmark rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, cast, get_args

Dtype = Literal["bf16", "fp16"]
KVFormatName = Literal["dtype", "e4m3", "ds_mla"]
QFormatName = Literal["dtype", "e4m3"]
MaskKind = Literal["causal", "tree", "none"]
Keys = Literal["paged", "gathered"]
Family = Literal["naive", "flash", "mma"]
Split = int | Literal["adaptive", "balanced"]
Schedule = Literal["lockstep", "seesaw", "transposed", "p_exchange", "fp8_ws", "fp8_mma", "fp8_ldg"]
Loads = Literal["cp_async", "tma"]
Combine = Literal["merge", "cluster"]
Partials = Literal["fp32", "16bit"]
Rows = Literal["dense", "ragged"]

# Each field's values, from its type.
DTYPES: tuple[str, ...] = get_args(Dtype)
KV_FORMATS: tuple[str, ...] = get_args(KVFormatName)
Q_FORMATS: tuple[str, ...] = get_args(QFormatName)
MASKS: tuple[str, ...] = get_args(MaskKind)
KEYS: tuple[str, ...] = get_args(Keys)
MAX_SEQLEN_Q = 64          # draft tokens per request a block can hold (tree masks are 64-bit rows)
FAMILIES: tuple[str, ...] = get_args(Family)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
LOADS: tuple[str, ...] = get_args(Loads)
COMBINES: tuple[str, ...] = get_args(Combine)
PARTIALS: tuple[str, ...] = get_args(Partials)
ROWS: tuple[str, ...] = get_args(Rows)


@dataclass(frozen=True)
class Problem:
    """What the kernel computes.

    heads: H, query heads sharing the one latent KV head.
    dl: latent (value) width, the first `dl` dims of each KV row (512 for DeepSeek/Kimi).
    dr: rope width appended to each KV row (64).
    dtype: element type of out (and of q and kv_cache where their formats are "dtype").
    page_size: KV rows per page of the paged cache.
    mask: "causal", "tree" (a per-request [S, S] draft-tree mask) or "none".
    lse: whether the kernel also writes lse [B, H, S] (fp32, natural log).
    kv_format: what the cache holds (docs/design.md, "FP8 KV caches"): "dtype" (rows of `dtype`
        values), "e4m3" (rows of dl + dr float8_e4m3fn values, times one kv_scale) or "ds_mla"
        (DeepSeek's 656-byte rows: 512 e4m3 latent dims, four fp32 scales, 64 bf16 rope dims).
    q_format: "dtype" (q in `dtype`) or "e4m3" (float8_e4m3fn, times one q_scale).
    keys: which cache rows each query row attends to (KEYS): "paged" (request b's first
        cache_seqlens[b] keys through its block_table row, the mask deciding which of the draft
        tokens each query sees) or "gathered" (sparse verify, DeepSeek Sparse Attention: query
        token i of request b attends to the rows indices[b, i, :topk_length[b]] lists, each a
        flat row id page x page_size + offset, -1 an unused slot; mask "none", since the indexer
        already chose). Named `_gather`.
    """

    heads: int = 64
    dl: int = 512
    dr: int = 64
    dtype: Dtype = "bf16"
    page_size: int = 64
    mask: MaskKind = "causal"
    lse: bool = False
    kv_format: KVFormatName = "dtype"
    q_format: QFormatName = "dtype"
    keys: Keys = "paged"

    @property
    def gathered(self) -> bool:
        """Whether each query row attends to the cache rows it lists (keys "gathered")."""
        return self.keys == "gathered"

    @property
    def fp8_kv(self) -> bool:
        """Whether the cache is FP8 (kv_format "e4m3" or "ds_mla")."""
        return self.kv_format != "dtype"

    @property
    def fp8_q(self) -> bool:
        """Whether q is FP8 (q_format "e4m3")."""
        return self.q_format != "dtype"

    @property
    def fp8(self) -> bool:
        """Whether any input is FP8 (the cache or q)."""
        return self.fp8_kv or self.fp8_q

    @property
    def head_dim(self) -> int:
        return self.dl + self.dr

    @property
    def name(self) -> str:
        lse = ("_lse" if self.lse else "") + ("_gather" if self.gathered else "")
        kv = (f"_kv{self.kv_format}" if self.fp8_kv else "") + (f"_q{self.q_format}" if self.fp8_q else "")
        return (
            f"h{self.heads}_dl{self.dl}_dr{self.dr}_{self.dtype}{kv}_p{self.page_size}_{self.mask}{lse}"
        )

    def with_(self, **changes: Any) -> Problem:
        return replace(self, **changes)

    def with_formats(self, kv_format: str, q_format: str) -> Problem:
        """This problem over inputs in `kv_format` and `q_format`. The output keeps `dtype`, the
        16-bit inputs' dtype, but e4m3 queries over an FP8 cache, where no input is 16-bit,
        write bf16."""
        dtype = "bf16" if kv_format != "dtype" and q_format != "dtype" else self.dtype
        return self.with_(kv_format=kv_format, q_format=q_format, dtype=dtype)


@dataclass(frozen=True)
class Variant:
    """How the kernel is built.

    family: "naive" (one block per query row), "flash" (head-tiled, split-KV, scalar FMA) or
        "mma" (head-tiled, split-KV, tensor cores through mma.sync).
    head_tile: HT, heads per block (divides H). naive: 1.
    q_tile: query positions per block (1..64); a block holds q_tile * head_tile query rows.
        naive: 1.
    kv_split: number of key-range splits, or "adaptive" (chosen per launch from the SM count
        and the KV capacity). With one split the block writes the final output directly.
        "balanced" (mma only, named `spb`): the requests' KV tiles form one list cut into about
        as many equal ranges as the SMs hold blocks per row group of a request, so a batch whose
        (row group, split) blocks would not fill whole waves keeps every SM busy; a request cut
        by a range end is merged like a split one.
    block_n: keys per shared-memory tile.
    warps: warps per block.
    stages: depth of the cp.async pipeline that stages KV tiles (naive: 1).
    arch: target, one of mlagen.dsl.arch.ARCHS ("sm_80", "sm_89", "sm_90", "sm_90a", "sm_120").
    schedule: how the mma family's tile loop runs (SCHEDULES; naive and flash: "lockstep"):
        "lockstep": every warp takes each KV tile in turn (scores, softmax, output product).
        "seesaw": sm_90a mma with TMA loads, both products on wgmma (no mma_pv), two stages, 64
            rows, 64-key tiles and the "merge" combine: the KV tiles go in pairs, each warpgroup
            computing one tile's scores and softmax while the other runs matrix work (P·V of both
            tiles per warpgroup on half the value dims; P through the tile's rope block). Named
            `_ss`.
        "transposed": sm_90a mma, q_tile*head_tile rows a multiple of 8 from 16 to 72, Dl=512 and
            Dr=64: the products run transposed, S^T = K Q^T and O^T = V^T P^T, so wgmma's N is the
            rows themselves and no row is padded to a 64-row group (H=8 S=9, H=16 S=2). The tiles
            go in pairs as in the seesaw, with a column softmax whose running max moves only when
            a score passes it by more than 8 (log2 units). cp.async or TMA loads, 64-key tiles,
            8 warps, two stages; shared memory is all of sm_90a's 227 KB for 72 rows. Named `_tr`.
        "p_exchange": a cluster split (combine "cluster") on sm_90a for short requests, whose row
            group's keys fit one 64-key tile per block of the cluster (the block table's capacity
            at most kv_split * 64 keys): each block scores its tile, and the blocks then exchange
            their P (16-bit, 8 KB a tile) and row maxima through distributed shared memory instead
            of partial output rows; each block adds every tile's P V for its share of the value
            dims and writes them out. 64-key tiles, 8 warps, one stage, cp.async loads, fp32
            partials (nothing partial is written). Named `_px`.
        "fp8_ws": sm_90a mma over an e4m3 cache, warp-specialized: the seesaw's two warpgroups
            (`warps` 8) run the tile pairs while a third, the producer, lands each tile's FP8
            bytes with TMA in the back of its 16-bit stage and widens them in place, so the
            widening runs beside the products instead of between them. 64 rows, 64-key tiles,
            two stages, TMA loads (block_n dividing the page size), the "merge" combine. Named
            `_ws`.
        "fp8_mma": sm_90a mma with e4m3 queries over an e4m3 cache, both products on e4m3
            wgmma (fp32 accumulation), warp-specialized as fp8_ws: the producer lands each tile's
            bytes with TMA and transposes its value dims into a key-major copy (8-bit wgmma reads
            K-major operands only); P goes to e4m3, scaled by 2^8. No widening anywhere. The
            same tile, splits and loads as fp8_ws. Named `_f8`.
        "fp8_ldg": sm_90a mma over a ds_mla cache, warp-specialized: the lockstep loop's two
            warpgroups (`warps` 8) run the products while a third, the producer, loads each
            tile's rows from global memory into its registers (16-byte loads, each row from its
            own address, so gathered keys take it), widens them there and stores the 16-bit tile:
            no FP8 byte passes through shared memory, and the widening runs beside the products.
            64 rows, 64-key tiles, two 16-bit stages, the "merge" combine. Named `_lg`.
    loads: how KV tiles reach shared memory (LOADS): "cp_async" (every thread's 16-byte copies)
        or "tma" (mma on sm_90a, block_n dividing the page size: TMA boxes,
        `cp.async.bulk.tensor`, one thread issues a tile's 64-dim column blocks, an mbarrier per
        stage says when it landed; runs through mlagen's runtime, which encodes the cache's
        descriptor). Named `_tma`.
    combine: how a row group's splits come together (COMBINES): "merge" (partial rows through
        the global workspace, merged by merge blocks or a pair's second block) or "cluster" (mma
        on sm_90/sm_90a with kv_split an int in 2..8: the splits run as one thread-block cluster
        and combine their output rows through distributed shared memory when their tiles are
        done, with no partials in global memory and no merge blocks; the split count is then a
        compile-time constant). Named `_cl`.
    partials: the type of a split's partial output rows (PARTIALS): "fp32" (unnormalized) or
        "16bit" (mma only: normalized, divided by their own row sum, in the output's dtype,
        through the workspace or through distributed shared memory with a cluster: half the
        bytes exchanged, for one more rounding of each partial to the output's precision, which
        the merged row gets anyway). Named `_p16`.
    mma_pv: sm_90a only: the output product P·V on mma.sync instead of wgmma (the scores stay
        on wgmma). Shorter per-tile latency, less tensor throughput; named `_pvm`.
    rows: which of a request's S query rows the kernel runs (ROWS): "dense" (all of them) or
        "ragged" (balanced split only; named `_rg`): request b's real rows are its last
        q_counts[b] (`verify_attention_varlen` pads shorter drafts at the front), and each row
        group's work list holds only the requests for which it has a real row, with every
        request's real row groups dealt round the blocks' row-group slots so that each slot holds
        about the same work. The outputs of padded rows are unspecified.
    """

    family: Family = "flash"
    head_tile: int = 8
    q_tile: int = 8
    kv_split: Split = "adaptive"
    block_n: int = 32
    warps: int = 8
    stages: int = 2
    arch: str = "sm_90"
    schedule: Schedule = "lockstep"
    loads: Loads = "cp_async"
    combine: Combine = "merge"
    partials: Partials = "fp32"
    mma_pv: bool = False
    rows: Rows = "dense"

    @property
    def name(self) -> str:
        return self._named(with_split=True)

    @property
    def code_name(self) -> str:
        """The name of the generated code: like `name` but without a split that is a launch
        parameter (see `split_compiled_in`)."""
        return self._named(with_split=self.split_compiled_in)

    @property
    def split_compiled_in(self) -> bool:
        """Whether the split is part of the generated code (the balanced split, `_spb`; a
        cluster's size, `_sp4` ... `_cl`) rather than a launch parameter (a counted or adaptive
        split)."""
        return self.kv_split == "balanced" or self.combine == "cluster"

    @property
    def code_variant(self) -> Variant:
        """The variant that stands for this one's generated code: itself, with a split that is a
        launch parameter set to "adaptive" (variants with equal code_variants share a kernel)."""
        if self.untiled or self.split_compiled_in:
            return self
        return self.with_(kv_split="adaptive")

    @property
    def untiled(self) -> bool:
        """Whether the family is the naive one (family "naive"), whose variant holds no tile (one
        block per query row, `naive`): the DSL's vocabulary, which its names and `code_variant`
        follow. Code above the DSL asks the family's registry entry instead
        (`mlagen.plan.families`, `KernelFamily.tiled`)."""
        return self.family == "naive"

    @property
    def seesaw(self) -> bool:
        """Whether the schedule is the seesaw (schedule "seesaw")."""
        return self.schedule == "seesaw"

    @property
    def transposed(self) -> bool:
        """Whether the schedule is the transposed tile (schedule "transposed")."""
        return self.schedule == "transposed"

    @property
    def p_exchange(self) -> bool:
        """Whether the schedule is the P exchange (schedule "p_exchange")."""
        return self.schedule == "p_exchange"

    def _named(self, with_split: bool) -> str:
        arch = self.arch.replace("_", "")
        if self.untiled:
            return f"naive_w{self.warps}_{arch}"
        split = _SPLIT_TAGS[self.kv_split] if isinstance(self.kv_split, str) else str(self.kv_split)
        return (
            f"{self.family}_ht{self.head_tile}_qt{self.q_tile}_bn{self.block_n}"
            f"_w{self.warps}_st{self.stages}{f'_sp{split}' if with_split else ''}{self._tags}_{arch}"
        )

    @property
    def _tags(self) -> str:
        """The name's part for the knobs (TAGS; "" for the defaults)."""
        return "".join(f"_{tag}" for field, value, tag in TAGS if getattr(self, field) == value)

    def with_(self, **changes: Any) -> Variant:
        return replace(self, **changes)


# The name's tags, in its order: (field, value, tag), the tag standing where the field has that
# value (each field's default has none).
TAGS: tuple[tuple[str, object, str], ...] = (
    ("mma_pv", True, "pvm"), ("combine", "cluster", "cl"), ("partials", "16bit", "p16"), ("loads", "tma", "tma"),
    ("schedule", "seesaw", "ss"), ("schedule", "transposed", "tr"), ("schedule", "p_exchange", "px"),
    ("schedule", "fp8_ws", "ws"), ("schedule", "fp8_mma", "f8"), ("schedule", "fp8_ldg", "lg"),
    ("rows", "ragged", "rg"),
)


# The name's part for a split that is not a count (`_spa`, `_spb`), and the split it names.
_SPLIT_TAGS: dict[str, str] = {"adaptive": "a", "balanced": "b"}
_SPLIT_NAMES: dict[str, Split] = {tag: cast(Split, split) for split, tag in _SPLIT_TAGS.items()}


def naive(arch: str = "sm_90", warps: int = 4) -> Variant:
    """The naive family's only shape of variant: one block per (request, query, head)."""
    return Variant(
        family="naive", head_tile=1, q_tile=1, kv_split=1, block_n=32, warps=warps, stages=1,
        arch=arch,
    )


def kernel_name(problem: Problem, variant: Variant) -> str:
    """The C symbol prefix of a (problem, variant) pair: `mlagen_<variant>_<problem>`."""
    return f"mlagen_{variant.code_name}_{problem.name}"


def parse_variant(name: str) -> Variant:
    """The Variant whose `name` is `name` (inverse of Variant.name)."""
    parts = name.split("_")
    knobs: dict[str, Any] = {}
    for field, value, tag in reversed(TAGS):
        if len(parts) > 8 and parts[-2] == tag and field not in knobs:
            knobs[field] = value
            del parts[-2]
    if parts[0] == "naive" and len(parts) == 3 and parts[1].startswith("w"):
        return naive(arch=_parse_arch(parts[2], name), warps=_parse_int(parts[1][1:], name))
    if parts[0] not in FAMILIES or len(parts) != 8:
        raise ValueError(f"variant name: got {name!r}, expected e.g. "
                         "'flash_ht8_qt8_bn32_w8_st2_spa_sm90', 'mma_ht64_qt1_bn64_w8_st2_spa_pvm_sm90a' "
                         "or 'naive_w4_sm90'")
    fields = dict(zip(("ht", "qt", "bn", "w", "st", "sp"), parts[1:7], strict=True))
    for key, part in fields.items():
        if not part.startswith(key):
            raise ValueError(f"variant name {name!r}: expected {key}<n> where {part!r} stands")
    split = fields["sp"][2:]
    return Variant(
        family=cast(Family, parts[0]), head_tile=_parse_int(fields["ht"][2:], name),
        q_tile=_parse_int(fields["qt"][2:], name), block_n=_parse_int(fields["bn"][2:], name),
        warps=_parse_int(fields["w"][1:], name), stages=_parse_int(fields["st"][2:], name),
        kv_split=_SPLIT_NAMES.get(split) or _parse_int(split, name),
        arch=_parse_arch(parts[7], name), **knobs,
    )


def _parse_int(text: str, name: str) -> int:
    if not text.isdigit():
        raise ValueError(f"variant name {name!r}: expected a number where {text!r} stands")
    return int(text)


def _parse_arch(text: str, name: str) -> str:
    if not text.startswith("sm"):
        raise ValueError(f"variant name {name!r}: expected an arch like sm90 where {text!r} stands")
    return "sm_" + text[2:]
