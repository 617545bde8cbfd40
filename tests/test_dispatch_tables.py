"""Bucket keys, tuned tables and the dispatcher, all without a GPU."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from balanced_worklist import aligned_ranges, packed_list, real_tiles, rotations, slot_q_tile, work_list
from hypothesis import given, settings
from hypothesis import strategies as st

from mlagen.dispatch import policy, tables
from mlagen.dispatch.policy import H200, policy_for
from mlagen.dsl.arch import CI_ARCHS, get_arch, runs_on
from mlagen.dsl.spec import FAMILIES, Problem, Variant, naive, parse_variant
from mlagen.plan.schedules import FP8_MMA
from mlagen.plan.space import split_variants, structures, tile_shapes, twin_variants
from mlagen.plan.tiles import FLASH_Q_TILE, MAX_ROWS, balanced_q_tile, enumerate_tiles
from mlagen.plan.validate import SEGMENT_TILES, UNSPLIT_SLACK_TILES, validate
from mlagen.tools import tune
from mlagen.tools.grids import Row, select_rows
from mlagen.tools.tune import candidates
from mlagen.tools.workload import problem_for

GPU = "Test GPU 9000"   # no shipped table has this name


@pytest.fixture(autouse=True)
def user_tables(tmp_path, monkeypatch):
    """Every test gets an empty user-table folder and fresh dispatch caches."""
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path / "tables"))
    policy.reset()
    yield tmp_path / "tables"
    policy.reset()


def _save(entries: dict, arch: str = "sm_90") -> None:
    tables.save_table(tables.Table(gpu=GPU, arch=arch, entries=entries), tables.user_table_path(GPU, arch))
    policy.reset()


def test_log2_buckets():
    assert [tables.log2_bucket(n) for n in (0, 1, 2, 3, 5, 6, 1024, 1088, 1500, 65600)] == [0, 0, 1, 2, 2, 3, 10, 10,
                                                                                             11, 16]


def test_bucket_key_names_every_field():
    p = Problem(heads=16, page_size=16, mask="tree", dtype="fp16")
    assert tables.bucket_key(p, 9, 64, 4160) == "h16_dl512_dr64_fp16_p16_tree_s9_b6_n12"
    assert tables.bucket_key(p, 9, 64, 4160, mask="causal").endswith("_causal_s9_b6_n12")


def test_fp8_inputs_have_buckets_of_their_own():
    """An FP8 cache or FP8 queries name their format in the key; 16-bit keys read as before."""
    p = Problem(heads=16, page_size=16, mask="tree", dtype="fp16")
    assert tables.bucket_key(p.with_(kv_format="e4m3"), 9, 64, 4160) == "h16_dl512_dr64_fp16_kve4m3_p16_tree_s9_b6_n12"
    assert tables.bucket_key(p.with_(kv_format="ds_mla", q_format="e4m3"), 9, 64, 4160) == (
        "h16_dl512_dr64_fp16_kvds_mla_qe4m3_p16_tree_s9_b6_n12")


def test_fp8_inputs_take_the_tables_pick_else_the_heuristic_tile():
    """Without a table an FP8 cache runs on the heuristic's mma tile (the balanced split for a
    batch) and e4m3 queries on that tile's fp8_mma schedule (both products on e4m3 wgmma); a
    tuned FP8 tile under its own key is dispatched, and a 16-bit key's pick never reaches it."""
    bf16, e4m3 = Problem(heads=64), Problem(heads=64, kv_format="e4m3")
    untuned = policy.fp8_tile(e4m3, 9, "sm_90", policy.H200)
    assert untuned.family == "mma" and untuned.loads == "cp_async" and untuned.schedule == "lockstep"
    assert policy.choose_variant(e4m3, 9, 1, 4160, "sm_90", GPU) == untuned
    assert policy.choose_variant(e4m3, 9, 64, 4160, "sm_90", GPU) == untuned.with_(kv_split="balanced")
    q8 = e4m3.with_(q_format="e4m3")
    assert policy.choose_variant(q8, 9, 1, 4160, "sm_90", GPU) == FP8_MMA.adopt(untuned)
    assert policy.choose_variant(q8, 9, 1, 4160, "sm_80", GPU) == naive("sm_80")
    seesaw = "mma_ht64_qt1_bn64_w8_st2_spa_p16_tma_ss_sm90a"
    _save({tables.bucket_key(bf16, 9, 1, 4160): {"variant": seesaw, "us": 1.0}})
    assert policy.choose_variant(e4m3, 9, 1, 4160, "sm_90", GPU) == untuned
    tile = "mma_ht64_qt1_bn64_w8_st2_spa_sm90a"
    _save({tables.bucket_key(e4m3, 9, 1, 4160): {"variant": tile, "us": 1.0},
           tables.bucket_key(e4m3, 9, 64, 4160): {"variant": tile, "us": 1.0}})
    assert policy.choose_variant(e4m3, 9, 1, 4160, "sm_90", GPU).name == tile
    batched = policy.choose_variant(e4m3, 9, 64, 4160, "sm_90", GPU)
    assert batched == parse_variant(tile).with_(kv_split="balanced") and validate(e4m3, batched)
    assert policy.choose_variant(q8, 9, 1, 4160, "sm_90", GPU) == FP8_MMA.adopt(untuned)


def test_the_tuner_searches_fp8_caches_among_the_tiles_that_read_them():
    """For an FP8 cache the candidates are the untuned pick (the heuristic's tile) first, the
    naive kernel, and mma lockstep tiles with cp.async loads, every one valid for it."""
    e4m3 = Problem(heads=64, kv_format="e4m3")
    cands = candidates(e4m3, 9, 8, 4160, "sm_90", 24, H200)
    assert cands[0] == policy.untuned_variant(e4m3, 9, 8, 4160, "sm_90", H200) and naive("sm_90") in cands
    assert all(validate(e4m3, v) for v in cands)
    tiles = [v for v in cands if v.family == "mma"]
    assert tiles and all((v.schedule, v.loads) == ("lockstep", "cp_async") for v in tiles)
    assert {v.arch for v in tiles} == {"sm_90", "sm_90a"}


def test_grid_rows_have_distinct_buckets():
    rows = select_rows(["seed", "serving"], [])
    keys = {tables.bucket_key(problem_for(r, 64, "causal", "bf16"), r.seqlen_q, r.batch, r.kv_capacity(64))
            for r, _ in rows}
    assert len(keys) == len(rows) == 19


def test_table_round_trip(tmp_path):
    t = tables.Table(gpu=GPU, arch="sm_120", entries={"k": {"variant": "naive_w4_sm120", "us": 1.5}},
                     meta={"date_utc": "x"})
    path = tmp_path / "t.json"
    tables.save_table(t, path)
    assert tables.load_table(path) == t


@pytest.mark.parametrize("text", ["not json", '{"format": 99, "gpu": "g", "arch": "sm_90"}', "[1]"])
def test_bad_table_is_refused_and_ignored_by_dispatch(tmp_path, text, user_tables):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        tables.load_table(path)
    user_tables.mkdir(parents=True)
    tables.user_table_path(GPU, "sm_90").write_text(text)
    policy.reset()
    p = Problem()
    assert policy.choose_variant(p, 9, 1, 4160, "sm_90", GPU) == policy.heuristic_variant(p, 9, "sm_90", H200)


def test_gpu_slug_and_default_path():
    assert tables.gpu_slug("NVIDIA H200") == "h200"
    assert tables.gpu_slug("NVIDIA RTX PRO 6000 Blackwell") == "rtx-pro-6000-blackwell"
    assert tables.default_table_path("NVIDIA H200") == tables.SHIPPED_DIR / "h200.json"


def test_shipped_tables_load():
    paths = sorted(tables.SHIPPED_DIR.glob("*.json"))
    assert tables.SHIPPED_DIR / "h200.json" in paths
    for path in paths:
        t = tables.load_table(path)
        for entry in t.entries.values():
            parse_variant(entry["variant"])


def test_without_table_dispatch_is_the_untuned_pick():
    p = Problem(heads=64)
    for s in (1, 9, 33, 64):
        for cap in (1024, 8192):
            untuned = policy.untuned_variant(p, s, 1, cap, "sm_90", H200)
            assert policy.choose_variant(p, s, 1, cap, "sm_90", GPU) == untuned


def test_a_devices_policy_scales_the_thresholds_of_work_per_sm():
    """`policy_for` builds a device's policy from H200's thresholds: those of work per SM and the
    P exchange's wave count over the device's SMs, the rest are the same on every device; the
    shared memory per block is the device's, at most the arch's."""
    assert policy_for("sm_90", 132) == H200 == policy_for("sm_90a", 132, 227 * 1024)
    h20 = policy_for("sm_90", 78)
    assert (h20.seesaw_tiles, h20.pdl_tiles, h20.exchange_blocks) == (12 * 78, 24 * 78, 78)
    assert (H200.seesaw_tiles, H200.pdl_tiles, H200.exchange_blocks) == (12 * 132, 24 * 132, 132)
    per_device = {"sm_count", "smem_per_block"}
    for f in dataclasses.fields(policy.DispatchPolicy):
        if f.name not in per_device:
            assert getattr(h20, f.name) == getattr(H200, f.name), f.name
    assert policy_for("sm_120", 188).smem_per_block == 99 * 1024              # the arch's
    assert policy_for("sm_90", 132, 300 * 1024).smem_per_block == 227 * 1024  # at most the arch's
    assert policy_for("sm_90", 132, 100 * 1024).smem_per_block == 100 * 1024
    for bad in ((0, None), (132, 0)):
        with pytest.raises(ValueError):
            policy_for("sm_90", *bad)
    with pytest.raises(ValueError, match="arch"):
        policy_for("sm_99", 132)
    # choose_variant's default is the H200's
    p = Problem(heads=64)
    assert policy.choose_variant(p, 9, 1, 10304, "sm_90", GPU) == policy.choose_variant(
        p, 9, 1, 10304, "sm_90", GPU, policy=policy_for("sm_90", 132))


def test_the_runtime_dispatches_with_the_devices_policy(monkeypatch):
    """The op builds its policy from the device: SM count (`device_info`) and the shared memory
    a block may opt into (torch's device properties; the arch's where torch has none)."""
    from types import SimpleNamespace

    from mlagen.runtime import op

    monkeypatch.setattr(op, "device_info", lambda index: ("sm_90", 78))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(shared_memory_per_block_optin=100 * 1024))
    assert op.device_policy(0) == policy_for("sm_90", 78, 100 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace())
    assert op.device_policy(0) == policy_for("sm_90", 78)


# Devices the invariants hold on: an H20's SM count, an H100 PCIe's, the H200's, a larger one;
# and an H200 whose blocks may opt into less shared memory than sm_90 allows.
DEVICES = [("sm_count", n, None) for n in (78, 114, 132, 170)] + [("smem", 132, 100 * 1024)]


@pytest.mark.parametrize("what,sm_count,smem", DEVICES)
def test_dispatched_variants_run_on_the_device(what, sm_count, smem):
    """Over a grid of shapes, with the shipped table and without one, on every CI arch: the
    runtime's pick validates, fits the arch's and the device's shared memory per block, runs on
    the arch, runs every key the block table addresses (a P exchange's cluster holds them, a
    balanced split's work list counts them), also when the plan is made for fewer keys
    (max_seqlen_k), and passes the runtime's checks of a variant named by the caller."""
    from mlagen.runtime.op import pick_variant

    for arch in CI_ARCHS:
        device = policy_for(arch, sm_count, smem)
        for gpu in ("NVIDIA H200", GPU):
            for heads in (1, 8, 16, 64, 128):
                for mask in ("causal", "tree"):
                    p = Problem(heads=heads, mask=mask, lse=mask == "tree")
                    for s in (1, 2, 3, 4, 9, 16, 33, 64):
                        for b in (1, 2, 64):
                            for keys, table in ((256, 256), (320, 131072), (4160, 4160), (65600, 65600)):
                                v = pick_variant(p, s, b, keys, table, arch, gpu, None, policy=device)
                                where = (arch, gpu, heads, mask, s, b, keys, table, v.name)
                                plan = validate(p, v)
                                assert plan.smem_bytes <= min(get_arch(arch).smem_per_block, device.smem_per_block)
                                assert runs_on(v.arch, arch), where
                                assert policy.covers(v, table), where
                                assert v.kv_split != "balanced" or policy.balanced_list_fits(v, b, table), where
                                assert pick_variant(p, s, b, keys, table, arch, gpu, v, policy=device) == v


def test_the_sm_count_moves_the_thresholds_of_work_per_sm():
    """Without a table: the seesaw, the transposed tile and programmatic launches in graphs switch
    at so many KV tiles of work per SM of the device, and a P exchange must fit one wave of its
    SMs. So the same launch is long on a device with fewer SMs and short on one with more."""
    p = Problem(heads=64)                      # ht64 qt1: 9 row groups at S=9
    base = policy.heuristic_variant(p, 9, "sm_90", H200)
    seesaw = base.with_(loads="tma", schedule="seesaw", kv_split="balanced")
    h20, pcie, big = (policy_for("sm_90", n) for n in (78, 114, 170))

    def untuned(problem: Problem, s: int, b: int, keys: int, device: policy.DispatchPolicy) -> Variant:
        return policy.untuned_variant(problem, s, b, keys, "sm_90", device)

    # 150 tiles x 9 row groups: 10.2 tiles per SM of an H200 (the lockstep tile), 17.3 of an H20
    assert untuned(p, 9, 1, 150 * 64, H200) == base and untuned(p, 9, 1, 150 * 64, h20) == seesaw
    # 190 tiles x 9: 13.0 per SM of an H200 (the seesaw), 10.1 on 170 SMs
    assert untuned(p, 9, 1, 190 * 64, H200) == seesaw and untuned(p, 9, 1, 190 * 64, big) == base
    for device in (h20, pcie, H200, big):      # the edge: 12 tiles per SM, 9 row groups
        edge = -(-12 * device.sm_count // 9) * 64
        assert untuned(p, 9, 1, edge - 64, device) == base and untuned(p, 9, 1, edge, device) == seesaw
        assert untuned(p, 9, 8, edge // 8 + 64, device) == seesaw       # the same work as a batch
        assert policy.choose_variant(p, 9, 1, edge, "sm_90", GPU, policy=device) == seesaw
    # the transposed tile (H=8 S=9: one row group of 72 rows) from 12 tiles per SM too
    h8 = Problem(heads=8)
    tile = policy.transposed_tile(h8, 9, "sm_90", H200)
    assert untuned(h8, 9, 1, 12 * 78 * 64, h20) == tile and not untuned(h8, 9, 1, 12 * 78 * 64, H200).transposed
    # the P exchange (H=16 S=4: one row group; 320 keys: clusters of 5): 26 requests are 130
    # blocks, one wave of an H200's SMs, not of an H20's
    h16 = Problem(heads=16)
    assert untuned(h16, 4, 26, 320, H200).p_exchange and not untuned(h16, 4, 26, 320, h20).p_exchange
    assert untuned(h16, 4, 15, 320, h20).p_exchange                                   # 75 blocks
    # programmatic launches in graphs: 2304 tiles are 17.5 per SM of an H200, 29.5 of an H20
    assert policy.dependent_in_graphs(seesaw, 64, 9, 1, 16384, H200)
    assert not policy.dependent_in_graphs(seesaw, 64, 9, 1, 16384, h20)


# The snapshot of the H200's picks: `choose_variant` on sm_90 with the H200's policy, for the
# shipped table ("NVIDIA H200") and without a table (""), over this grid of causal bf16 shapes
# (pages of 64 keys), each row {first capacity: pick} at every capacity where the pick changes.
SNAPSHOT = Path(__file__).resolve().parent / "data" / "dispatch_h200.json"
SNAPSHOT_ENV = "MLAGEN_WRITE_DISPATCH_SNAPSHOT"
SNAPSHOT_GRID = {"heads": [1, 8, 16, 32, 64, 128], "seqlen_q": [1, 2, 4, 9, 16, 33, 64],
                 "batch": [1, 2, 8, 32, 64, 128], "kv_capacity": [2**k for k in range(8, 18)]}


def _h200_picks() -> dict:
    picks: dict = {"grid": SNAPSHOT_GRID}
    for gpu in ("NVIDIA H200", ""):
        rows = picks.setdefault(gpu or "no table", {})
        for heads in SNAPSHOT_GRID["heads"]:
            p = Problem(heads=heads)
            for s in SNAPSHOT_GRID["seqlen_q"]:
                for b in SNAPSHOT_GRID["batch"]:
                    row, last = {}, None
                    for keys in SNAPSHOT_GRID["kv_capacity"]:
                        name = policy.choose_variant(p, s, b, keys, "sm_90", gpu, policy=H200).name
                        if name != last:
                            row[str(keys)], last = name, name
                    rows[f"H={heads} S={s} B={b}"] = row
    return picks


def _snapshot_text(picks: dict) -> str:
    """`picks` as JSON with a line per row, so that a moved pick is a line of the diff."""
    sections = [f' "grid": {json.dumps(picks["grid"])}']
    for gpu in ("NVIDIA H200", "no table"):
        rows = ",\n".join(f"  {json.dumps(row)}: {json.dumps(p)}" for row, p in picks[gpu].items())
        sections.append(f" {json.dumps(gpu)}: {{\n{rows}\n }}")
    return "{\n" + ",\n".join(sections) + "\n}\n"


def test_the_h200s_picks_match_the_snapshot():
    """The shipped table's and the heuristic's picks on the H200 over a grid of shapes, against
    tests/data/dispatch_h200.json. A change to the table, a threshold or the heuristic that moves
    a pick shows here; if it is meant, write the snapshot anew and review its diff:

        MLAGEN_WRITE_DISPATCH_SNAPSHOT=1 python -m pytest tests/test_dispatch_tables.py -k snapshot
    """
    got = _h200_picks()
    if os.environ.get(SNAPSHOT_ENV):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(_snapshot_text(got))
    want = json.loads(SNAPSHOT.read_text())
    moved = [f"{gpu} {row}: {want[gpu].get(row)} -> {picks}" for gpu in ("NVIDIA H200", "no table")
             for row, picks in got[gpu].items() if want[gpu].get(row) != picks]
    assert got["grid"] == want["grid"] and not moved, \
        f"{len(moved)} rows of picks moved (set {SNAPSHOT_ENV}=1 to write them):\n" + "\n".join(moved[:20])


@pytest.mark.parametrize("heads,seqlen_q,batch,keys", [(64, 16, 32, 4096), (16, 9, 64, 4096), (8, 9, 16, 16384),
                                                      (64, 9, 1, 256), (64, 9, 1, 65536)])
def test_ragged_rows_take_the_balanced_picks_ragged_kernel(heads, seqlen_q, batch, keys):
    """A call that says which rows are real (q_counts) runs the same pick, with ragged rows where
    it is a balanced split, and the same pick otherwise."""
    problem = Problem(heads=heads, mask="tree")
    dense = policy.choose_variant(problem, seqlen_q, batch, keys, "sm_90a", "NVIDIA H200")
    ragged = policy.choose_variant(problem, seqlen_q, batch, keys, "sm_90a", "NVIDIA H200", ragged_rows=True)
    if dense.kv_split == "balanced":
        assert ragged == dense.with_(rows="ragged") and validate(problem, ragged).split.ragged_rows
    else:
        assert ragged == dense


def test_untuned_short_one_wave_launches_run_the_p_exchange_on_sm90a():
    """Without a table, the heuristic's sm_90a tile runs as a P exchange where the block table
    holds at most 8 KV tiles and row groups x requests x cluster size fit one wave of the device's
    SMs (`DispatchPolicy.exchange_blocks`: 132 on the H200)
    (H200: 0.58-0.97x the split's time on seven such shapes); not past either
    bound, and not on other archs."""
    p = Problem(heads=64)
    base = policy.heuristic_variant(p, 9, "sm_90", H200)
    px = policy.untuned_variant(p, 9, 1, 320, "sm_90", H200)
    assert px == base.with_(kv_split=5, combine="cluster", schedule="p_exchange", stages=1, partials="fp32")
    assert policy.choose_variant(p, 9, 2, 320, "sm_90", "Other GPU") == px         # a batch keeps it
    assert policy.untuned_variant(p, 9, 1, 100, "sm_90", H200).kv_split == 2
    assert policy.untuned_variant(p, 9, 1, 512, "sm_90", H200).kv_split == 8            # 6-8 tiles: 8 (6, 7 do not fit)
    assert not policy.untuned_variant(p, 9, 2, 512, "sm_90", H200).p_exchange            # 2 x 9 x 8 = 144 blocks
    assert not policy.untuned_variant(p, 9, 1, 513, "sm_90", H200).p_exchange            # 9 tiles
    assert not policy.untuned_variant(p, 9, 3, 320, "sm_90", H200).p_exchange            # 3 x 9 x 5 = 135 blocks
    assert policy.untuned_variant(p.with_(heads=16), 4, 26, 320, "sm_90", H200).p_exchange   # 130 blocks
    assert not policy.untuned_variant(p.with_(heads=16), 4, 27, 320, "sm_90", H200).p_exchange
    for arch in ("sm_80", "sm_89", "sm_120"):
        assert not policy.untuned_variant(p, 9, 1, 320, arch, H200).p_exchange


def test_short_launches_go_as_programmatic_dependents_in_graphs():
    """Up to 24 KV tiles of work per SM (row groups x requests x tiles): the bench's short rows
    (S=9 at 256 to 16384 keys, S=33 at 256 to 4096), not its long or batched ones."""
    split = parse_variant("mma_ht32_qt2_bn64_w8_st2_spa_p16_sm90a")       # 10 row groups at S=9
    seesaw = parse_variant("mma_ht64_qt1_bn64_w8_st2_spa_p16_tma_ss_sm90a")  # 9 at S=9, 33 at S=33

    def dependent(v: Variant, h: int, s: int, b: int, keys: int) -> bool:
        return policy.dependent_in_graphs(v, h, s, b, keys, H200)

    assert dependent(parse_variant(EXCHANGE), 64, 9, 1, 320)
    assert dependent(split, 64, 9, 1, 1024) and dependent(split, 64, 9, 1, 4096)
    assert dependent(seesaw, 64, 9, 1, 16384)                  # 2304 tiles: 17.5 a SM
    assert dependent(seesaw, 64, 33, 1, 4096)                  # 2112: 16
    assert dependent(seesaw, 64, 9, 1, 64 * 352)               # 3168: 24
    assert not dependent(seesaw, 64, 9, 1, 64 * 353)
    assert not dependent(seesaw, 64, 9, 1, 65536)              # 9216: 70
    assert not dependent(seesaw, 64, 1, 128, 4096)             # 8192: 62
    assert not dependent(parse_variant("mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a"), 16, 4, 64, 4096)  # 31
    assert not dependent(seesaw, 64, 9, 8, 4096)               # 4608: 35
    assert policy.dependent_in_graphs(seesaw, 64, 9, 1, 16384, policy_for("sm_90", 264))   # a larger device takes more


def test_untuned_long_launches_run_the_seesaw_on_sm90a():
    """Without a table, an sm_90a mma tile goes on the seesaw schedule (TMA loads, balanced split)
    from `DispatchPolicy.seesaw_tiles` KV tiles of work (requests x row groups x tiles; where that
    edge lies on each device: `test_the_sm_count_moves_the_thresholds_of_work_per_sm`), a single
    request with one range per SM; page sizes TMA cannot box and other archs keep the heuristic's
    tile as it is."""
    p = Problem(heads=64)
    base = policy.heuristic_variant(p, 9, "sm_90", H200)
    assert base.arch == "sm_90a" and (base.head_tile, base.q_tile) == (64, 1) and not base.seesaw
    long = policy.untuned_variant(p, 9, 1, 131136, "sm_90", H200)
    assert long == base.with_(loads="tma", schedule="seesaw", kv_split="balanced")   # one wave, one request too
    validate(p, long)
    assert policy.num_splits(long, 64, 1, 9, 131136, H200) == 132 // 9      # 9 row groups
    # no TMA box for pages of 16 keys: no seesaw
    small_pages = p.with_(page_size=16)
    assert not policy.untuned_variant(small_pages, 9, 1, 65600, "sm_90", H200).seesaw
    # other archs: the heuristic as it is
    for arch in ("sm_80", "sm_89", "sm_120"):
        assert policy.untuned_variant(p, 9, 1, 65600, arch, H200) == policy.heuristic_variant(p, 9, arch, H200)


@pytest.mark.parametrize("heads,seqlen_q", [(8, 9), (16, 2), (8, 4), (16, 1), (8, 6)])
def test_untuned_long_launches_take_the_transposed_tile_where_rows_fit_one(heads, seqlen_q):
    """Rows (H*S) from 16 to 72 other than 64 go to one transposed tile of all of them, from
    `DispatchPolicy.seesaw_tiles` KV tiles of work (counted over that single row group), on
    devices that run sm_90a only; the tuner times that tile whatever the work."""
    p = Problem(heads=heads)
    edge = H200.seesaw_tiles * 64        # keys of one request
    tile = policy.transposed_tile(p, seqlen_q, "sm_90", H200)
    assert tile == Variant(family="mma", head_tile=heads, q_tile=seqlen_q, kv_split="balanced", block_n=64,
                           warps=8, stages=2, arch="sm_90a", partials="16bit", schedule="transposed")
    validate(p, tile)
    assert policy.untuned_variant(p, seqlen_q, 1, edge, "sm_90", H200) == tile
    assert policy.untuned_variant(p, seqlen_q, 16, edge // 16, "sm_90a", H200) == tile
    assert not policy.untuned_variant(p, seqlen_q, 1, edge - 64, "sm_90", H200).transposed
    assert policy.untuned_variant(p, seqlen_q, 16, 4160, "sm_90", H200) != tile        # H=8 S=9 at 4096 keys: short
    for arch in ("sm_80", "sm_89", "sm_120"):
        assert not policy.untuned_variant(p, seqlen_q, 1, edge, arch, H200).transposed
        assert policy.transposed_tile(p, seqlen_q, arch, H200) is None
    assert tile in candidates(p, seqlen_q, 1, 4160, "sm_90", 24, H200)
    assert tile.with_(loads="tma") in twin_variants(p, [tile])          # the tuner times its TMA loads too
    assert tile.with_(loads="tma") not in twin_variants(Problem(heads=heads, page_size=16), [tile])
    assert not any(v.transposed for v in candidates(p, seqlen_q, 1, 4160, "sm_80", 24, H200))


@pytest.mark.parametrize("heads,seqlen_q", [(64, 1), (8, 8), (16, 9), (64, 9), (1, 9), (2, 4), (8, 1)])
def test_rows_that_fill_64_row_groups_or_miss_the_range_take_no_transposed_tile(heads, seqlen_q):
    p = Problem(heads=heads)
    assert policy.transposed_tile(p, seqlen_q, "sm_90", H200) is None
    assert not policy.untuned_variant(p, seqlen_q, 64, 65600, "sm_90", H200).transposed


def test_dispatch_reads_the_table_then_neighbours_then_causal():
    p = Problem(heads=64)
    tuned = "flash_ht4_qt9_bn64_w8_st2_sp8_sm90"
    _save({tables.bucket_key(p, 9, 1, 4160): {"variant": tuned, "us": 10.0,
                                               "families": {"naive": {"variant": "naive_w8_sm90", "us": 99.0}}}})
    assert policy.choose_variant(p, 9, 1, 4160, "sm_90", GPU).name == tuned
    assert policy.choose_variant(p, 9, 1, 8256, "sm_90", GPU).name == tuned            # one KV step longer
    assert policy.choose_variant(p.with_(mask="tree"), 9, 1, 4160, "sm_90", GPU).name == tuned
    assert policy.choose_variant(p, 9, 1, 65600, "sm_90", GPU) == policy.untuned_variant(p, 9, 1, 65600, "sm_90", H200)
    assert policy.choose_variant(p, 9, 64, 4160, "sm_90", GPU) == policy.balanced_for_batch(
        p, policy.untuned_variant(p, 9, 64, 4160, "sm_90", H200), 64, H200)
    assert policy.choose_variant(p, 9, 1, 4160, "sm_90", "Other GPU") == policy.heuristic_variant(p, 9, "sm_90", H200)
    assert policy.family_variant(p, 9, 1, 4160, "sm_90", GPU, "naive", H200).name == "naive_w8_sm90"
    flash = policy.family_variant(p, 9, 1, 4160, "sm_90", GPU, "flash", H200)
    assert flash == policy.flash_heuristic(p, 9, "sm_90", H200)
    # no table for another GPU: the mma column is the untuned pick, the seesaw on a long launch
    assert policy.family_variant(p, 9, 1, 65600, "sm_90", "Other GPU", "mma", H200).seesaw
    sm80 = policy.family_variant(p, 9, 1, 4160, "sm_80", "Other GPU", "mma", H200)
    assert sm80 == policy.heuristic_variant(p, 9, "sm_80", H200)


@pytest.mark.parametrize("name", ["flash_ht3_qt9_bn32_w8_st2_spa_sm90",     # 3 does not divide 64
                                  "flash_ht8_qt8_bn32_w8_st2_spa_sm120",    # another arch
                                  "not a variant"])
def test_a_table_entry_that_does_not_fit_is_passed_over(name):
    p = Problem(heads=64)
    _save({tables.bucket_key(p, 9, 1, 4160): {"variant": name, "us": 1.0}})
    assert policy.choose_variant(p, 9, 1, 4160, "sm_90", GPU) == policy.heuristic_variant(p, 9, "sm_90", H200)


def test_num_splits_bounds():
    v = Variant(family="flash", head_tile=8, q_tile=9, arch="sm_90")
    assert policy.num_splits(v, 64, 1, 9, 64, H200) == 1                 # too short to split
    assert 1 < policy.num_splits(v, 64, 1, 9, 65600, H200) <= H200.max_splits
    assert policy.num_splits(v.with_(kv_split=5), 64, 1, 9, 64, H200) == 5
    assert policy.num_splits(naive(), 64, 1, 9, 65600, H200) == 1


def test_num_splits_counts_the_seesaws_tiles_in_pairs():
    """The seesaw's split hands out whole pairs of tiles: 65-66 tiles over 9 row groups take 11
    splits of 6 tiles (14 would leave three of them empty, writing partials for nothing); the
    lockstep kernel, a tile at a time, takes 13-14 of 5. The transposed tile's warpgroups take a
    tile each too (its split_blocks<2>)."""
    lockstep = parse_variant("mma_ht64_qt1_bn64_w8_st2_spa_p16_sm90a")
    seesaw = parse_variant("mma_ht64_qt1_bn64_w8_st2_spa_p16_tma_ss_sm90a")
    transposed = parse_variant("mma_ht8_qt9_bn64_w8_st2_spa_p16_tr_sm90a")
    assert policy.split_unit(seesaw) == policy.split_unit(transposed) == 2 and policy.split_unit(lockstep) == 1
    assert [policy.num_splits(seesaw, 64, 1, 9, cap, H200) for cap in (4160, 4224)] == [11, 11]
    assert [policy.num_splits(lockstep, 64, 1, 9, cap, H200) for cap in (4160, 4224)] == [13, 14]
    # S=33, 17 tiles over 33 row groups (at most 4 splits a wave): 3 splits of three pairs
    assert policy.num_splits(seesaw, 64, 1, 33, 1088, H200) == 3


def test_space_candidates_validate_and_are_bounded():
    p = Problem(heads=64)
    for fam in FAMILIES:
        for v in structures(p, 33, "sm_90", fam, limit=12):
            validate(p, v)
    cands = candidates(p, 9, 1, 4160, "sm_90", 10, H200)
    assert len(cands) <= 10 and len(set(cands)) == len(cands)
    assert cands[0] == policy.heuristic_variant(p, 9, "sm_90", H200)
    assert candidates(p, 9, 1, 65600, "sm_90", 10, H200)[0] == policy.untuned_variant(p, 9, 1, 65600, "sm_90", H200)
    assert any(v.family == "naive" for v in cands)


def test_space_tries_both_output_products_on_sm90a():
    found = structures(Problem(heads=64), 9, "sm_90a", "mma")
    assert {v.mma_pv for v in found} == {False, True} and not found[0].mma_pv
    assert not any(v.mma_pv for v in structures(Problem(heads=64), 9, "sm_90", "mma"))


def test_tile_shapes_prefer_fewer_kv_passes():
    shapes = tile_shapes(64, 9)
    passes = [-(-9 // q) * (64 // h) for h, q in shapes]
    assert passes == sorted(passes) and all(h * q <= 128 for h, q in shapes)


def test_the_tuner_and_the_heuristics_take_their_tiles_from_the_enumeration():
    """The tuner's tile shapes are the balanced ones up to MAX_ROWS rows, reordered; the mma
    heuristic's tile is one of every q tile up to `max_mma_rows` rows, and the flash heuristic's
    q tile the balanced one of at most FLASH_Q_TILE positions."""
    for heads in (1, 8, 48, 128):
        p = Problem(heads=heads)
        for s in (1, 2, 5, 9, 16, 33, 64):
            assert sorted(tile_shapes(heads, s)) == enumerate_tiles(heads, s, MAX_ROWS, balanced=True)
            mma = policy.heuristic_mma(p, s, "sm_90", H200)
            assert mma is not None and (mma.head_tile, mma.q_tile) in enumerate_tiles(heads, s, H200.max_mma_rows)
            assert policy.flash_heuristic(p, s, "sm_90", H200).q_tile == balanced_q_tile(s, FLASH_Q_TILE)


def test_split_variants():
    p = Problem(heads=64)
    v = Variant(family="flash", head_tile=8, q_tile=9, block_n=32, arch="sm_90")
    splits = [w.kv_split for w in split_variants(p, v, 256, skip=2)]
    assert splits == [1, 4, 8]           # at most 256/32 = 8 tiles; the adaptive one skipped
    mma = v.with_(family="mma", q_tile=8)
    found = split_variants(p, mma, 256, skip=2)
    assert [w.kv_split for w in found if w.combine == "merge"] == [1, 4, 8, "balanced"]
    assert [w.kv_split for w in found if w.combine == "cluster"] == [2, 4, 8]     # cluster sizes, one kernel each
    # 128 keys: 4 tiles, so no cluster of 8; sm_80 has no clusters
    assert [w.kv_split for w in split_variants(p, mma, 128, skip=2) if w.combine == "cluster"] == [2, 4]
    assert not [w for w in split_variants(p, mma.with_(arch="sm_80"), 256, skip=2) if w.combine == "cluster"]


def test_twin_variants_are_the_knobs_that_make_kernels_of_their_own():
    p = Problem(heads=64)
    mma = parse_variant("mma_ht64_qt1_bn64_w8_st2_spa_sm90a")
    found = twin_variants(p, [mma, mma.with_(kv_split=1), mma.with_(kv_split=4, combine="cluster", partials="16bit"),
                              parse_variant("flash_ht8_qt8_bn32_w8_st2_sp4_sm90"), naive(),
                              parse_variant("mma_ht64_qt1_bn32_w8_st2_spa_sm80")])
    assert [v.name for v in found] == [
        "mma_ht64_qt1_bn64_w8_st2_spa_p16_sm90a", "mma_ht64_qt1_bn64_w8_st2_spa_tma_sm90a",
        "mma_ht64_qt1_bn64_w8_st2_spa_p16_tma_sm90a",
        "mma_ht64_qt1_bn64_w8_st2_spa_tma_ss_sm90a", "mma_ht64_qt1_bn64_w8_st2_spa_p16_tma_ss_sm90a",
        "mma_ht64_qt1_bn64_w8_st2_sp1_tma_sm90a",                    # one split: nothing exchanged
        "mma_ht64_qt1_bn64_w8_st2_sp1_tma_ss_sm90a",
        "mma_ht64_qt1_bn64_w8_st2_sp4_cl_p16_tma_sm90a",             # part16 already: TMA; no seesaw in a cluster
        "mma_ht64_qt1_bn32_w8_st2_spa_p16_sm80",                     # sm_80: no TMA
    ]
    # pages shorter than a tile: no TMA twin
    assert twin_variants(Problem(heads=64, page_size=16), [mma]) == [mma.with_(partials="16bit")]


def test_tune_times_the_tables_previous_pick_second():
    """The table's previous pick for a row (the incumbent) joins the row's candidates right after
    the untuned pick, once; a name that does not parse, validate for the problem or run on the
    device's arch is left out, and the row is tuned without one."""
    problem = problem_for(Row(heads=64, batch=1, seqlen_q=9, prefix=1024), 64, "causal", "bf16")
    cands = candidates(problem, 9, 1, 1088, "sm_90", 8, H200)
    old = parse_variant("mma_ht32_qt2_bn64_w8_st1_sp4_p16_sm90a")
    assert old not in cands
    got, incumbent = tune.with_incumbent(problem, "sm_90", cands, old.name)
    assert incumbent == old and got == [cands[0], old] + cands[1:]
    got, incumbent = tune.with_incumbent(problem, "sm_90", cands, cands[3].name)   # one of them already
    assert incumbent == cands[3] and got[:2] == [cands[0], cands[3]] and sorted(got, key=str) == sorted(cands, key=str)
    for name in (None, "", "not_a_variant", "mma_ht64_qt2_bn64_w8_st2_spa_sm90a",   # 128 rows: no such tile
                 "mma_ht32_qt1_bn32_w4_st1_sm120"):                              # another arch's
        assert tune.with_incumbent(problem, "sm_90", cands, name) == (cands, None), name
    result = tune.RowTune(row=Row(64, 1, 9, 1024), mask="causal", key="k",
                          trials=[tune.Trial(cands[0], 12.0), tune.Trial(old, 11.0)], incumbent=old)
    assert result.incumbent_trial.us == 11.0
    assert tune.RowTune(row=Row(64, 1, 9, 1024), mask="causal", key="k").incumbent_trial is None


def test_tune_times_knob_twins_of_the_fastest_last(monkeypatch):
    """The tuner's stage before the retimes times the knob twins (16-bit partials, TMA loads) of
    the fastest few trials, each once, and the table entry takes one when it wins."""
    from types import SimpleNamespace

    row = Row(heads=64, batch=1, seqlen_q=9, prefix=1024)
    problem = problem_for(row, 64, "causal", "bf16")
    work = SimpleNamespace(row=row, problem=problem, kv_capacity=1088)
    timed = []

    def fake_time(work, trial, timing, give_up_us):
        timed.append(trial.variant)
        v = trial.variant
        trial.us = (10.0 + v.block_n / 64 + (v.kv_split == 4) * -1 + (v.partials == "16bit") * -0.5
                    + (v.family != "mma") * 50)
        trial.samples.append(trial.us)

    monkeypatch.setattr(tune, "_time", fake_time)
    cands = candidates(problem, 9, 1, 1088, "sm_90", 8, H200)
    result = tune._tune_one(work, cands, {}, tune.TuneConfig(), dispatch=H200, advance=lambda more=0: None)
    config = tune.TuneConfig()
    retimed = timed[-config.retime_top * config.retimes:]   # the last stage: the fastest 3, in turns
    assert retimed == retimed[:config.retime_top] * config.retimes
    searched = timed[:-len(retimed)]
    assert len(searched) == len(set(searched))              # nothing timed twice before that
    # the stage before: knob twins (part16, tma, both) of variants timed earlier (the
    # heuristic's own pick may be part16 already, and so its splits)
    twins = [v for i, v in enumerate(searched)
             if (v.partials == "16bit" or v.loads == "tma")
             and v.with_(partials="fp32", loads="cp_async", schedule="lockstep") in searched[:i]]
    assert twins and len(twins) <= 5 * config.split_top
    assert searched[-len(twins):] == twins
    assert result.best.variant.partials == "16bit" and result.best.variant.kv_split == 4
    assert result.entry()["variant"] == result.best.variant.name
    assert all(len(t.samples) == 1 + config.retimes for t in result.trials if t.variant in retimed)


def test_tune_times_twins_of_the_fastest_structures_not_of_one_structures_splits(monkeypatch):
    """The heuristic's pick is part16 already and its fixed splits come close behind it; the
    stages after the structures still reach the second structure, whose part16 twin wins (as on
    the H200's 256-key row before the P exchange: one stage fewer, 16-bit partials). 1024 keys:
    too many tiles for the P exchange, which the untuned pick would be at 256."""
    from types import SimpleNamespace

    row = Row(heads=64, batch=1, seqlen_q=9, prefix=1024)
    problem = problem_for(row, 64, "causal", "bf16")
    work = SimpleNamespace(row=row, problem=problem, kv_capacity=1088)
    cands = candidates(problem, 9, 1, 1088, "sm_90", 20, H200)
    pick = cands[0]
    one_stage = pick.with_(stages=1, partials="fp32")
    assert pick.partials == "16bit" and one_stage in cands

    def fake_time(work, trial, timing, give_up_us):
        v = trial.variant
        same_shape = (v.family, v.head_tile, v.q_tile, v.arch) == (pick.family, pick.head_tile, pick.q_tile, pick.arch)
        if not same_shape:
            trial.us = 14.0 + (v.family != "mma") * 50
        else:
            p16 = v.partials == "16bit"
            trial.us = ((12.8 - 1.1 * p16) if v.stages == 2 else (12.6 - 1.4 * p16)) \
                + 0.1 * (v.kv_split != "adaptive") + 0.5 * (v.loads == "tma") + 0.3 * v.mma_pv
        trial.samples.append(trial.us)

    monkeypatch.setattr(tune, "_time", fake_time)
    result = tune._tune_one(work, cands, {}, tune.TuneConfig(), dispatch=H200, advance=lambda more=0: None)
    assert result.best.variant == one_stage.with_(partials="16bit")


def test_tune_ranks_the_fastest_by_the_median_of_their_timings(monkeypatch):
    """A trial whose first timing was a fluke (far too fast) is timed again and loses to the one
    that is fast every time."""
    from types import SimpleNamespace

    row = Row(heads=64, batch=8, seqlen_q=9, prefix=4096)
    problem = problem_for(row, 64, "causal", "bf16")
    work = SimpleNamespace(row=row, problem=problem, kv_capacity=4160)
    lucky = parse_variant("mma_ht64_qt1_bn64_w8_st2_spb_sm90a")
    seen: dict = {}

    def fake_time(work, trial, timing, give_up_us):
        n = seen[trial.variant] = seen.get(trial.variant, 0) + 1
        if trial.variant == lucky:
            us = 50.0 if n == 1 else 120.0          # a fluke, then its real figure
        else:
            us = 100.0 + 10 * (trial.variant.partials == "16bit") + (trial.variant.family != "mma") * 100
        trial.samples.append(us)
        trial.us = sorted(trial.samples)[len(trial.samples) // 2]

    monkeypatch.setattr(tune, "_time", fake_time)
    result = tune._tune_one(work, [lucky] + candidates(problem, 9, 8, 4160, "sm_90", 6, H200), {}, tune.TuneConfig(),
                            dispatch=H200, advance=lambda more=0: None)
    assert seen[lucky] == 3 and result.best.variant != lucky and result.best.us == 100.0


@settings(max_examples=300, deadline=None)
@given(data=st.data(), batch=st.integers(1, 40), seqlen_q=st.integers(1, 40), capacity_tiles=st.integers(1, 300),
       sm_count=st.integers(1, 200), shape=st.sampled_from([(64, 1), (32, 2), (16, 4), (8, 8)]),
       kernel=st.sampled_from(["lockstep", "seesaw", "transposed"]))
def test_balanced_split_gives_every_tile_to_one_block(data, batch, seqlen_q, capacity_tiles, sm_count, shape, kernel):
    """The balanced split, worked through as the kernel does it from ragged lengths (templates/
    split_work_list.cuh.j2, split_merge_blocks.cuh.j2's merge block, mma_ops.cuh.j2's range loop;
    tests/balanced_worklist.py is its twin): every request's KV tile goes to exactly one range (run
    by that range's block of every row group), the ranges that meet a request fill the consecutive
    workspace slots its merge reads, no slot of the launch repeats or passes the workspace, a
    request without keys is left to its merge (0 splits), a range's tiles and the segment costs of
    the requests it starts fit its length, an aligned range meets one request and holds no more
    tiles than a packed range holds positions (the fewest that fit), or a request's whole, a slack
    more, when none is split, the split blocks fit the resident slots, and the grid has a merge
    block per group part. The seesaw's and the transposed tile's lists count pairs of tiles
    (`SplitPlan.split_unit`), and their segment cost in pairs."""
    heads, block_n = 64, 64
    paired = kernel != "lockstep"
    v = Variant(family="mma", head_tile=shape[0], q_tile=shape[1], block_n=block_n, warps=8, stages=2,
                kv_split="balanced", arch="sm_90a" if paired else "sm_90",
                loads="tma" if kernel == "seesaw" else "cp_async", schedule=kernel)
    parts = policy.balanced_parts(v, heads, batch, seqlen_q, capacity_tiles * block_n, sm_count)
    device = policy_for("sm_90", sm_count)
    assert policy.num_splits(v, heads, batch, seqlen_q, capacity_tiles * block_n, device) == parts
    plan = validate(Problem(heads=heads), v)
    groups = -(-seqlen_q // v.q_tile) * (heads // v.head_tile)
    assert parts * groups <= max(sm_count, groups)       # one wave, unless one group per SM is already more
    lengths = data.draw(st.lists(st.integers(0, capacity_tiles * block_n), min_size=batch, max_size=batch))
    unit = plan.split.split_unit
    assert unit == (2 if paired else 1) and plan.split.segment_units * unit >= SEGMENT_TILES
    tiles = [-(-n // (block_n * plan.split.split_unit)) for n in lengths]     # the list's units
    wl = work_list(tiles, parts, plan.split.segment_units, plan.split.unsplit_slack_units)
    packed = packed_list(tiles, parts, plan.split.segment_units)
    assert wl.aligned or wl == packed
    if wl.aligned:                                       # the fewest tiles a range may hold, or a request's whole
        assert wl.aligned <= packed.per or wl.aligned == max(tiles) <= packed.per + plan.split.unsplit_slack_units
        assert aligned_ranges(tiles, wl.aligned) <= parts and (
            wl.aligned == 1 or aligned_ranges(tiles, wl.aligned - 1) > parts)

    owner: dict[tuple[int, int], int] = {}
    slots_of: dict[int, set[int]] = {b: set() for b in range(batch)}
    for y in range(parts):
        u0, u1 = y * wl.per, min(y * wl.per + wl.per, wl.total)
        if u0 >= u1:
            continue
        b = wl.request_at(u0)
        assert b < batch
        start, run, segments = wl.start(b), 0, 0
        while start < u1:
            first, splits = wl.splits(b)
            share = wl.range_tiles(b, u0, u1)
            if share:
                assert first <= y < first + splits
                slots_of[b].add(y + b)
                for t in share:
                    assert (b, t) not in owner
                    owner[(b, t)] = y
                    run += 1
                segments += 1
            else:
                assert not first <= y < first + splits   # its merge counts no split of this range
            start += wl.span(b)
            b += 1
        assert run + wl.cost * (segments - 1) <= wl.per  # every segment after the first starts inside it
        assert not wl.aligned or (segments == 1 and run <= wl.aligned)
    assert len(owner) == sum(tiles)
    used = [slot for b in range(batch) for slot in slots_of[b]]
    slots = plan.split.partial_rows(batch, seqlen_q, parts) // (seqlen_q * heads)   # what the workspace holds
    assert len(used) == len(set(used)) and all(0 <= slot < slots for slot in used)
    for b in range(batch):
        first, splits = wl.splits(b)
        assert slots_of[b] == set(range(first + b, first + b + splits))   # what its merge reads
        assert (splits == 0) == (tiles[b] == 0)          # no keys: its merge writes zeros, lse -inf
    grid = plan.grid(batch, seqlen_q, parts)
    assert grid[:2] == (groups, parts) and plan.split.split_launch(parts)
    assert (grid[2] - 1) * groups * parts >= batch * groups * plan.split.merge_blocks(batch, seqlen_q)


@pytest.mark.parametrize("tiles,ranges,aligned,splits", [
    ([65] * 64, 132, 33, [2] * 64),          # H=16 B=64 S=4, 4096 keys, on 132 SMs: two blocks a request
    ([257] * 16, 128, 33, [8] * 16),         # H=8 B=16 S=9 on 128 ranges: as packed, and aligned
    ([257] * 16, 132, 0, None),              # H=8 B=16 S=9, 16384 keys: aligned would hold 33 tiles, packed 32
    ([65] * 128, 132, 65, [1] * 128),        # H=64 B=128 S=1: every request on one block, no merge
    ([129] * 64, 66, 129, [1] * 64),         # H=64 B=64 S=2, 8192 keys: one tile past packed, but no merge
    ([65] * 32, 14, 0, None),                # H=64 B=32 S=9 (9 row groups): more requests than ranges
    ([260, 2, 3, 1] * 8, 132, 0, None),      # short requests would each hold a range nearly empty
])
def test_balanced_split_layout_of_uniform_and_ragged_batches(tiles, ranges, aligned, splits):
    wl = work_list(tiles, ranges, SEGMENT_TILES, UNSPLIT_SLACK_TILES)
    assert wl.aligned == aligned
    if splits:
        assert [wl.splits(b)[1] for b in range(len(tiles))] == splits
        shares = {len(wl.range_tiles(0, u, u + wl.per)) for u in range(0, wl.span(0), wl.per)}
        assert max(shares) - min(shares) <= 1    # a request's ranges share its tiles evenly


def test_batches_take_the_balanced_split_of_the_chosen_tile():
    p = Problem(heads=64)
    base = policy.heuristic_variant(p, 9, "sm_90", H200)
    assert base.family == "mma" and base.kv_split == "adaptive"
    for batch, cap in ((2, 4160), (32, 16384), (64, 8256)):
        untuned = policy.untuned_variant(p, 9, batch, cap, "sm_90", H200)
        assert policy.choose_variant(p, 9, batch, cap, "sm_90", "Other GPU") == untuned.with_(kv_split="balanced")
    assert policy.choose_variant(p, 9, 1, 4160, "sm_90", "Other GPU") == base       # one request
    # a tuned tile keeps its shape; its split becomes balanced for a batch
    tuned = "mma_ht32_qt2_bn64_w8_st2_sp4_sm90a"
    _save({tables.bucket_key(p, 9, 32, 16384): {"variant": tuned, "us": 10.0}})
    chosen = policy.choose_variant(p, 9, 32, 16384, "sm_90", GPU)
    assert chosen == parse_variant(tuned).with_(kv_split="balanced")
    # a cluster split is sized by the capacity as well: a batch gets the balanced one instead
    clustered = parse_variant("mma_ht64_qt1_bn64_w8_st2_sp4_cl_sm90a")
    assert policy.balanced_for_batch(p, clustered, 8, H200) == parse_variant("mma_ht64_qt1_bn64_w8_st2_spb_sm90a")
    assert policy.balanced_for_batch(p, clustered, 1, H200) == clustered
    # the flash family has no balanced split: unchanged
    flash = policy.flash_heuristic(p, 9, "sm_90", H200)
    assert policy.balanced_for_batch(p, flash, 8, H200) == flash


def test_tuner_times_a_batch_as_the_dispatcher_runs_it():
    from mlagen.tools.tune import as_dispatched

    p = Problem(heads=64)
    cands = candidates(p, 9, 1, 4160, "sm_90", 24, H200)
    one = as_dispatched(p, 1, cands, H200)
    assert one == cands                                          # one request: as listed
    many = as_dispatched(p, 8, cands, H200)
    assert all(v.kv_split == "balanced" for v in many if v.family == "mma")
    assert [v for v in many if v.family != "mma"] == [v for v in cands if v.family != "mma"]
    assert len(many) == len(set(many)) and many[0] == policy.balanced_for_batch(p, cands[0], 8, H200)


EXCHANGE = "mma_ht64_qt1_bn64_w8_st1_sp5_cl_px_sm90a"


def test_split_variants_offer_the_p_exchange_where_the_table_holds_few_tiles():
    """The P exchange gives each KV tile a block of the cluster: the smallest size that fits
    the block table's tiles (6 and 7 do not fit shared memory, so 8 takes 6-8 tiles), none past
    8 tiles or before sm_90a."""
    p = Problem(heads=64)
    v = parse_variant("mma_ht32_qt2_bn64_w8_st2_spa_p16_sm90a")

    def exchange(capacity: int, variant: Variant = v) -> list[str]:
        return [w.name for w in split_variants(p, variant, capacity, skip=0) if w.p_exchange]

    assert exchange(320) == ["mma_ht32_qt2_bn64_w8_st1_sp5_cl_px_sm90a"]       # one stage, no part16
    assert exchange(100) == ["mma_ht32_qt2_bn64_w8_st1_sp2_cl_px_sm90a"]
    assert exchange(384) == exchange(512) == ["mma_ht32_qt2_bn64_w8_st1_sp8_cl_px_sm90a"]
    assert exchange(513) == [] and exchange(320, v.with_(arch="sm_90", partials="fp32")) == []


def test_a_p_exchange_entry_is_passed_over_where_the_table_holds_more_keys():
    """A bucket spans a factor of two of capacities: its P exchange over 5 tiles serves 320
    keys, not 352 (the bucket's untuned pick answers), nor a neighbour's 640."""
    p = Problem(heads=64)
    _save({tables.bucket_key(p, 9, 1, 320): {"variant": EXCHANGE, "us": 9.4}})
    assert tables.bucket_key(p, 9, 1, 320) == tables.bucket_key(p, 9, 1, 352)
    assert policy.choose_variant(p, 9, 1, 320, "sm_90", GPU).name == EXCHANGE
    for capacity in (352, 640):
        assert policy.choose_variant(p, 9, 1, capacity, "sm_90", GPU) == policy.untuned_variant(
            p, 9, 1, capacity, "sm_90", H200)


def test_a_p_exchange_entry_a_length_shorter_hands_over_to_the_p_exchange_for_these_keys():
    """512 keys, between a 256-key bucket that runs the P exchange on 5 blocks and a 1024-key
    bucket that runs a split: the P exchange sized for 8 tiles answers, where it fits one wave
    (H200: 10.3 µs against the split's 12.55); past one wave the split does."""
    p = Problem(heads=64)
    split = "mma_ht32_qt2_bn64_w8_st2_spa_p16_sm90a"
    _save({tables.bucket_key(p, 9, 1, 256): {"variant": EXCHANGE, "us": 7.7},
           tables.bucket_key(p, 9, 1, 1024): {"variant": split, "us": 14.7},
           tables.bucket_key(p, 9, 2, 256): {"variant": EXCHANGE, "us": 8.7},
           tables.bucket_key(p, 9, 2, 1024): {"variant": split, "us": 15.0}})
    eight = policy.choose_variant(p, 9, 1, 512, "sm_90", GPU)
    assert eight.name == EXCHANGE.replace("_sp5_", "_sp8_")
    assert policy.choose_variant(p, 9, 1, 1024, "sm_90", GPU).name == split
    # B=2: 2 requests x 9 row groups x 8 blocks = 144 blocks, past one wave of 132 SMs
    batched = policy.balanced_for_batch(p, parse_variant(split), 2, H200)
    assert policy.choose_variant(p, 9, 2, 512, "sm_90", GPU) == batched


def test_a_call_picks_a_variant_that_runs_every_key_the_block_table_holds():
    """max_seqlen_k plans for fewer keys than the table holds; a P exchange planned so gives way
    to the pick for the whole table, and a named one is refused, naming what it holds."""
    from mlagen.runtime.inputs import InputError
    from mlagen.runtime.op import pick_variant

    p = Problem(heads=64)
    _save({tables.bucket_key(p, 9, 1, 320): {"variant": EXCHANGE, "us": 9.4}})
    assert pick_variant(p, 9, 1, 320, 320, "sm_90", GPU, None, policy=H200).name == EXCHANGE
    whole_table = policy.choose_variant(p, 9, 1, 4096, "sm_90", GPU, policy=H200)
    assert pick_variant(p, 9, 1, 320, 4096, "sm_90", GPU, None, policy=H200) == whole_table
    named = parse_variant(EXCHANGE)
    assert pick_variant(p, 9, 1, 4096, 320, "sm_90", GPU, named, policy=H200) == named
    with pytest.raises(InputError, match=r"variant: got .*_px_sm90a', a P exchange over 5 tiles of 64 keys, expected "
                                         r"a block_table that addresses at most 320 keys \(it addresses 4096\)"):
        pick_variant(p, 9, 1, 320, 4096, "sm_90", GPU, named, policy=H200)
    with pytest.raises(InputError, match="variant.arch"):
        pick_variant(p, 9, 1, 320, 320, "sm_80", GPU, named, policy=H200)


def test_a_balanced_split_whose_work_list_cannot_count_the_table_gives_way_or_is_refused():
    """The balanced split counts the batch's KV tiles in int32 on the device; past that (~2^37
    keys over the batch) a call runs the dispatched tile with the adaptive split, and a named
    balanced variant is refused before any launch, naming the split to use instead."""
    from mlagen.runtime.inputs import InputError
    from mlagen.runtime.op import pick_variant

    p = Problem(heads=64)
    spb = parse_variant("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a")
    edge = (policy.BALANCED_LIST_POSITIONS // 2 - policy.SEGMENT_TILES) * 64   # two requests fill the list
    assert policy.balanced_list_fits(spb, 2, edge) and not policy.balanced_list_fits(spb, 2, edge + 1)
    chosen = policy.choose_variant(p, 9, 2, 4096, "sm_90", GPU)
    assert chosen.kv_split == "balanced"
    assert pick_variant(p, 9, 2, 4096, edge, "sm_90", GPU, None, policy=H200) == chosen
    assert pick_variant(p, 9, 2, 4096, edge + 1, "sm_90", GPU, None, policy=H200) == chosen.with_(kv_split="adaptive")
    assert pick_variant(p, 9, 2, 4096, edge, "sm_90", GPU, spb, policy=H200) == spb
    with pytest.raises(InputError, match=r"variant: got 'mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a', a "
                                         r"balanced split, .* for each of 2 requests \(expected a fixed or adaptive "
                                         r"split, e\.g\. 'mma_ht64_qt1_bn64_w8_st2_spa_p16_tma_ss_sm90a'\)"):
        pick_variant(p, 9, 2, 4096, edge + 1, "sm_90", GPU, spb, policy=H200)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90", "sm_120"])
def test_the_batch_invariant_pick_follows_the_problem_alone(arch):
    """The same variant whatever the device's SM count; a fixed split (each request's own keys
    in INVARIANT_SPLITS ranges), never a split that follows the batch or the table; valid."""
    from mlagen.dispatch.policy import INVARIANT_SPLITS, batch_invariant_variant, policy_for

    for heads, seqlen_q in [(1, 1), (8, 9), (16, 2), (16, 4), (64, 1), (64, 9), (64, 33), (128, 4), (3, 64)]:
        for mask in ("causal", "tree", "none"):
            for page in (1, 16, 64):
                problem = Problem(heads=heads, page_size=page, mask=mask, lse=True)
                picks = {batch_invariant_variant(problem, seqlen_q, arch, policy_for(arch, sms))
                         for sms in (78, 114, 132, 170)}
                assert len(picks) == 1, picks
                v, = picks
                assert v.kv_split in (INVARIANT_SPLITS, 1) and v.combine == "merge" and not v.p_exchange, v.name
                validate(problem, v)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), batch=st.integers(1, 40), seqlen_q=st.integers(1, 24), q_tile=st.sampled_from([1, 2, 4, 8]),
       ranges=st.integers(1, 12))
def test_ragged_rows_deal_each_real_row_group_to_one_slot_and_rows_of_its_own(data, batch, seqlen_q, q_tile, ranges):
    """Ragged rows worked through as the kernel does it (templates/split_work_list.cuh.j2,
    split_merge_blocks.cuh.j2, common.cuh.j2's part_row; tests/balanced_worklist.py its twin):
    each query-tile slot's list holds the requests with a real tile there; every real (request,
    query tile) sits in exactly one slot, whose ranges run each of its KV tiles once, where the
    merge looks for it; no padded tile runs; partial rows, numbered range + request within a
    slot's list and placed at the slot's query-tile position, never meet another group's and stay
    inside ranges + B - 1 slots of whole query tiles; with every row real the layout is the dense
    one."""
    counts = data.draw(st.lists(st.integers(0, seqlen_q), min_size=batch, max_size=batch))
    units = data.draw(st.lists(st.integers(0, 30), min_size=batch, max_size=batch))
    slots = -(-seqlen_q // q_tile)
    rot = rotations(counts, seqlen_q, q_tile)
    assert rotations([seqlen_q] * batch, seqlen_q, q_tile) == [0] * batch
    assert all(slot_q_tile(seqlen_q, 0, qs, seqlen_q, q_tile) == qs for qs in range(slots))
    ran: dict[tuple[int, int, int], int] = {}          # (request, query tile, KV tile) -> slot
    rows: dict[tuple[int, int], tuple[int, int]] = {}  # (workspace slot, slot row) -> (request, query tile)
    for qs in range(slots):
        held = [slot_q_tile(c, r, qs, seqlen_q, q_tile) for c, r in zip(counts, rot, strict=True)]
        wl = work_list([u if x >= 0 else 0 for u, x in zip(units, held, strict=True)], ranges, 3, 2)
        for y in range(ranges):                            # run_range: the requests from request_at on
            u0, u1 = y * wl.per, min(y * wl.per + wl.per, wl.total)
            b0 = wl.request_at(u0) if u0 < u1 else batch
            start = wl.start(b0) if b0 < batch else u1
            for b in range(b0, batch):
                if start >= u1:
                    break
                share, start = wl.range_tiles(b, u0, u1), start + wl.span(b)
                if not share:
                    continue
                x = held[b]
                assert x >= 0 and y + b < ranges + batch - 1
                for t in share:
                    assert (b, x, t) not in ran
                    ran[(b, x, t)] = qs
                for r in range(q_tile):
                    assert rows.setdefault((y + b, qs * q_tile + r), (b, x)) == (b, x)
                    assert qs * q_tile + r < slots * q_tile
    for b, (c, r) in enumerate(zip(counts, rot, strict=True)):
        first, real = real_tiles(c, seqlen_q, q_tile)
        for x in range(slots):
            padded = not first <= x < first + real
            assert padded == (x * q_tile + q_tile <= seqlen_q - c or c == 0)
            for t in range(units[b]):
                assert ((b, x, t) in ran) != padded
                if not padded:
                    assert ran[(b, x, t)] == (r + x - first) % slots       # the merge's slot
