"""`mlagen emit` and the rest of the CLI; generated/ must match what the code emits now."""

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from mlagen.codegen.compiler import compile_source
from mlagen.codegen.render import render
from mlagen.dispatch.policy import H200, untuned_variant
from mlagen.dispatch.presets import DEFAULT_EMIT_ARCHS, EMIT_KEYS, PRESETS
from mlagen.dsl.arch import runs_on
from mlagen.dsl.spec import naive
from mlagen.plan.params import FIELDS, PARAMS_SIZE
from mlagen.plan.validate import validate
from mlagen.tools.cli import app
from mlagen.tools.emit import emit_one, emit_preset

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def test_generated_folder_is_up_to_date(tmp_path):
    fresh = emit_preset(PRESETS["kimi-k2"], DEFAULT_EMIT_ARCHS, tmp_path).kernels
    for e in fresh:
        committed = ROOT / "generated" / e.source.relative_to(tmp_path)
        for mine, theirs in ((e.source, committed), (e.manifest, committed.with_suffix(".json"))):
            assert theirs.exists(), f"{theirs} missing: run `mlagen emit`"
            assert theirs.read_text() == mine.read_text(), f"{theirs} is stale: run `mlagen emit`"
    committed = {p.relative_to(ROOT / "generated") for p in (ROOT / "generated" / "kimi-k2").rglob("*.cu")}
    assert committed == {e.source.relative_to(tmp_path) for e in fresh}, "generated/ holds extra files"


def test_presets_cover_short_and_long_contexts():
    """Each preset's Hopper kernels are the dispatcher's untuned picks for a short and a long
    context: the lockstep wgmma tile and its seesaw twin with TMA loads and the balanced split;
    other archs have no seesaw (it is sm_90a only). Sparse verify presets (gathered keys) emit
    the naive kernel and the dispatcher's one-token tiles."""

    for preset in PRESETS.values():
        if preset.problem.gathered:    # naive and the one-token tiles with cp.async row gathers
            for a in ("sm_80", "sm_90", "sm_120"):
                variants = preset.variants(a)
                assert variants[0] == naive(a) and all(validate(preset.problem, v) for v in variants)
                assert all(untuned_variant(preset.problem, s, 1, k, a, H200) in variants
                           for s in preset.seqlens_q for k in EMIT_KEYS)
                assert all(v.q_tile == 1 and v.loads == "cp_async" for v in variants[1:])
            continue
        if preset.problem.fp8_kv:      # FP8 caches: naive and the lockstep tiles, no TMA or seesaw
            for a in ("sm_80", "sm_90", "sm_90a", "sm_120"):
                variants = preset.variants(a)
                assert variants[0] == naive(a) and len(variants) > 1
                assert all(validate(preset.problem, v) for v in variants)
                assert all(untuned_variant(preset.problem, s, 1, k, a, H200) in variants
                           for s in preset.seqlens_q for k in EMIT_KEYS)
                assert not any(v.loads == "tma" or v.seesaw for v in variants)
            continue
        hopper = preset.variants("sm_90")
        seesaw = [v for v in hopper if v.seesaw]
        assert len(seesaw) == 1 and seesaw[0].loads == "tma" and seesaw[0].kv_split == "balanced"
        assert seesaw[0].with_(loads="cp_async", schedule="lockstep", kv_split="adaptive") in hopper
        assert all(untuned_variant(preset.problem, s, 1, k, "sm_90", H200) in hopper
                   for s in preset.seqlens_q for k in EMIT_KEYS)
        assert not any(v.seesaw for v in preset.variants("sm_120"))


def test_emit_default_writes_sm90_and_sm120_with_manifests(tmp_path):
    result = runner.invoke(app, ["emit", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for arch in ("sm_90", "sm_120"):
        files = list((tmp_path / "kimi-k2" / arch).glob("*.cu"))
        assert files
        for f in files:
            meta = json.loads(f.with_suffix(".json").read_text())
            assert runs_on(meta["arch"], arch) and meta["problem"]["heads"] == 64
            assert meta["params"]["size"] == PARAMS_SIZE
            assert [x["name"] for x in meta["params"]["fields"]] == [x.name for x in FIELDS]
            for k in meta["kernels"]:
                assert re.search(rf'__global__ void __launch_bounds__\({k["block"][0]}(, 1)?\)\s*{k["name"]}\(',
                                 f.read_text())
    again = runner.invoke(app, ["emit", "--out", str(tmp_path)])
    assert re.search(r": 0 of (\d+) files written, \1 unchanged$", again.stdout.splitlines()[-1]), again.stdout
    assert all(line.startswith("unchanged  ") for line in again.stdout.splitlines()[:-1])


def test_emitted_file_compiles_alone(tmp_path):
    runner.invoke(app, ["emit", "--preset", "deepseek-v3-tp8", "--arch", "sm_89", "--out", str(tmp_path)])
    for f in (tmp_path / "deepseek-v3-tp8" / "sm_89").glob("*.cu"):
        meta = json.loads(f.with_suffix(".json").read_text())
        module = compile_source(f.read_text(), meta["name"], "sm_89")
        assert {k["name"] for k in meta["kernels"]} == set(module.resources)


def test_preset_emit_removes_its_stale_kernels_only(tmp_path):
    folder = tmp_path / "kimi-k2" / "sm_90"
    folder.mkdir(parents=True)
    stale = folder / "mlagen_mma_ht2_qt1_bn32_w4_st1_sm90_h64_old.cu"
    stale.write_text("// an earlier emit's kernel\n")
    mine = folder / "engine_notes.cu"
    mine.write_text("// the user's own file\n")
    done = emit_preset(PRESETS["kimi-k2"], ("sm_90",), tmp_path)
    assert not stale.exists() and mine.exists() and done.removed == [stale]
    assert {p.name for p in folder.glob("mlagen_*.cu")} == {
        f"{validate(PRESETS['kimi-k2'].problem, v).name}.cu" for v in PRESETS["kimi-k2"].variants("sm_90")}


def test_emit_with_launcher_headers(tmp_path):
    result = runner.invoke(app, ["emit", "--arch", "sm_90", "--launcher", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for source in (tmp_path / "kimi-k2" / "sm_90").glob("*.cu"):
        header = source.with_name(source.stem + "_launch.h")
        assert header.exists() and "cudaStream_t" in header.read_text()


def test_emit_named_variant_and_errors(tmp_path):
    ok = runner.invoke(app, ["emit", "--variant", "flash_ht4_qt4_bn32_w4_st2_spa_sm80", "--out", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert list((tmp_path / "kimi-k2" / "sm_80").glob("mlagen_flash_ht4_qt4_bn32_w4_st2_sm80_*.cu"))
    bad = runner.invoke(app, ["emit", "--arch", "sm_70", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "--arch: got 'sm_70'" in bad.output
    bad = runner.invoke(app, ["emit", "--preset", "llama", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "preset: got 'llama'" in bad.output
    bad = runner.invoke(app, ["emit", "--variant", "flash_ht7_qt4_bn64_w4_st3_spa_sm80", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "variant.head_tile: got 7" in bad.output
    ok = runner.invoke(app, ["emit", "--variant", "mma_ht8_qt4_bn32_w4_st2_spb_sm80", "--launcher",
                             "--out", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert list((tmp_path / "kimi-k2" / "sm_80").glob("mlagen_mma_ht8_qt4_bn32_w4_st2_spb_sm80_*_launch.h"))
    bad = runner.invoke(app, ["emit", "--variant", "flash_ht4_qt4_bn32_w4_st2_spb_sm80", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "'balanced' is mma only" in bad.output


def test_list_show_check():
    out = runner.invoke(app, ["list"])
    assert out.exit_code == 0 and all(name in out.output for name in PRESETS)
    v = PRESETS["kimi-k2"].variants("sm_90")[1]
    shown = runner.invoke(app, ["show", v.name, "--source", "--compile"])
    assert shown.exit_code == 0, shown.output
    plan = validate(PRESETS["kimi-k2"].problem, v)
    assert shown.stdout == render(plan).rstrip("\n") + "\n"          # the source alone on stdout
    assert "registers" in shown.stderr and "spill stores" in shown.stderr     # the compile report beside it
    checked = runner.invoke(app, ["check", "--arch", "sm_90", "--preset", "kimi-k2-tp8"])
    assert checked.exit_code == 0, checked.output
    assert "bytes: allowed (transposed tile, stack" in checked.stdout          # which spills pass, and why
    assert "Spills fail check, but for one allowance: a transposed tile" in " ".join(checked.stdout.split())
    assert checked.stdout.splitlines()[-1].endswith("within the transposed tile's allowance, none beyond it")


def test_variants_that_differ_in_a_launch_split_share_one_file(tmp_path):
    """_spa and _sp2 run one kernel: one file, the same bytes whichever is emitted, named by the kernel."""
    p = PRESETS["kimi-k2"]
    adaptive = next(v for v in p.variants("sm_90") if v.kv_split == "adaptive" and v.family == "mma")
    first = emit_one(p.problem, adaptive, tmp_path / "a")
    second = emit_one(p.problem, adaptive.with_(kv_split=2), tmp_path / "b")
    assert first.source.name == second.source.name == f"mlagen_{adaptive.code_name}_{p.problem.name}.cu"
    assert "_spa" not in first.source.name and "_sp2_" in second.variant.name
    for a, b in zip(first.files, second.files, strict=True):
        assert a.read_bytes() == b.read_bytes()
    out = runner.invoke(app, ["emit", "--variant", adaptive.name, "--variant", adaptive.with_(kv_split=2).name,
                              "--out", str(tmp_path)])
    assert f"(variants {adaptive.name}, {adaptive.with_(kv_split=2).name})" in out.stdout
    assert out.stdout.splitlines()[-1].startswith("1 kernel file for preset kimi-k2")
