"""The demo worlds' builders in ``tools/`` (a source checkout's, not installed): they import, their stages cover
the shipped assets, the checks compare file by file and can fail, the ``BUILD.md`` writer gives the shipped page,
and the cheap builds rebuild the shipped files bit-identically (the arithmetic LM's whole build, ~1 min; the image
world's CLIP stage). The longer rebuilds are commands, not tests: ``python -m tools.build_shapes_world check --stage
all`` (~15 min; each stage alone: ``--stage data | clip | head | sd3 | sdxl``) and ``python -m tools.build_vlm check``
(~10 min)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "unialign" / "embedded" / "assets" / "image"
ARITH = ROOT / "unialign" / "embedded" / "assets" / "arith_lm"


def test_tools_are_not_part_of_the_installed_package():
    import re

    from setuptools import find_packages

    section = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.packages.find]", 1)[1].split("\n[", 1)[0]
    include = re.findall(r'"([^"]+)"', re.search(r"include\s*=\s*\[(.*?)\]", section).group(1))
    assert include == ["unialign*"] and "exclude" not in section
    packages = find_packages(str(ROOT), include=include)
    assert "unialign.embedded" in packages and not any(p.split(".")[0] == "tools" for p in packages), packages
    import unialign.embedded

    assert not list(Path(unialign.embedded.__file__).parent.glob("*build*.py"))  # the builders left the package


def test_compare_sees_identical_different_missing_and_record_views(tmp_path):
    from tools.asset_check import compare, json_without

    a, b = tmp_path / "built", tmp_path / "shipped"
    for root, seconds, weight in ((a, 1.5, b"w1"), (b, 9.0, b"w2")):
        (root / "sub").mkdir(parents=True)
        (root / "sub" / "same.txt").write_text("x")
        (root / "weights.bin").write_bytes(weight)
        (root / "record.json").write_text(json.dumps({"loss": 0.1, "timings": {"s": seconds}}))
    (b / "only_shipped.txt").write_text("y")
    (b / "HAND.md").write_text("by hand")
    result = compare(a, b, views={"record.json": json_without("timings.s")}, skip=("HAND.md",))
    assert dict((p, v) for p, v, _ in result.rows) == {
        "only_shipped.txt": "not rebuilt", "record.json": "equal without timings", "sub/same.txt": "identical",
        "weights.bin": "DIFFERENT"}
    assert not result.ok and "1 of 4 files bit-identical" in result.table()
    assert compare(a, b, prefixes=("sub/",)).ok
    (a / "record.json").write_text(json.dumps({"loss": 0.2, "timings": {"s": 1.0}}))  # a measured number moved
    assert dict((p, v) for p, v, _ in compare(a, b, ("record.json",), views={
        "record.json": json_without("timings.s")}).rows) == {"record.json": "DIFFERENT"}


def test_image_stages_cover_the_shipped_assets_and_read_the_shipped_arguments():
    from tools.asset_check import files_under
    from tools.build_shapes_world import STAGES, shipped_arguments

    # reader/: the second fidelity reader, built and checked by its own tool (tools.build_shape_reader)
    shipped = {f for f in files_under(IMAGE) if not f.startswith("reader/")}
    for stage, (writes, reads) in STAGES.items():
        for prefix in writes + reads:
            assert files_under(IMAGE, (prefix,)), (stage, prefix)
    by_stages = set(files_under(IMAGE, [p for s, (w, _) in STAGES.items() if s != "all" for p in w]))
    assert shipped - by_stages == {"BUILD.md", "build_report.json"}  # the records: written by the whole build only
    kw, sd3_kw = shipped_arguments(IMAGE)
    assert kw == dict(seed=0, clip_steps=150, head_steps=1500, vae_steps=1000, unet_steps=1000, per_prompt=16,
                      threads=1, n_eval=64)
    assert sd3_kw == dict(seed=0, steps=5000, batch_size=64, per_prompt=16, threads=1, shift=1.0, lr=1e-3)
    with pytest.raises(ValueError, match="stage: 'unet' is not one of data, clip"):
        from tools.build_shapes_world import rebuild_stage

        rebuild_stage("unet", IMAGE)


def test_build_md_is_the_writers_page_of_the_shipped_report_and_its_timings_are_what_a_rebuild_may_change():
    from tools.build_shapes_world import LEGACY_NAME, MODULE_NAME, build_markdown, mask_page_timings

    report = json.loads((IMAGE / "build_report.json").read_text())
    page = (IMAGE / "BUILD.md").read_text()
    assert build_markdown(report) == page.replace(LEGACY_NAME, MODULE_NAME)  # the shipped page, byte for byte
    assert (IMAGE / "build_report.json").read_text() == json.dumps(report, indent=1)  # as build writes it
    slower = json.loads(json.dumps(report))
    slower["timings_s"] = {k: 2 * v + 1 for k, v in report["timings_s"].items()}
    slower["eval"]["sample_seconds"] += 1.0
    slower["sd3"]["timings_s"] = {"build": 1.0, "eval": 2.0}
    assert build_markdown(slower) != build_markdown(report)
    assert mask_page_timings(build_markdown(slower)) == mask_page_timings(page)
    worse = json.loads(json.dumps(report))
    worse["eval"]["fidelity"]["test_cfg3"] = 0.5
    worse["sd3"]["final_loss"] += 1e-3
    assert mask_page_timings(build_markdown(worse)) != mask_page_timings(page)


def test_the_data_stage_rebuilds_bit_identically(tmp_path):
    from tools.build_shapes_world import check

    result = check("data", IMAGE, keep=tmp_path / "data")
    assert result.ok and [p for p, _, _ in result.rows] == ["prompts.json", "tokenizer/merges.txt",
                                                            "tokenizer/vocab.json"], result.table()
    with pytest.raises(FileExistsError, match="not empty"):
        check("data", IMAGE, keep=tmp_path / "data")


@pytest.mark.slow
def test_the_clip_stage_rebuilds_bit_identically():
    """150 contrastive steps on one thread (20-45 s): the shipped CLIP weights, byte for byte (on the machine type
    the assets were built on)."""
    from tools.asset_check import other_machine_kind
    from tools.build_shapes_world import check

    if other_machine_kind():
        pytest.skip(other_machine_kind())

    result = check("clip", IMAGE)
    assert result.ok and "clip/open_clip_model.safetensors" in [p for p, _, _ in result.rows], result.table()


def test_arith_check_rebuilds_with_the_shipped_record_and_compares_every_file_it_writes(tmp_path, capsys):
    """Wiring only (3 steps, not the shipped 280): the files that do not depend on training are identical, the
    weights and the record are not; the full check is ``python -m tools.build_arith_lm check``."""
    from tools.asset_check import PASSING
    from tools.build_arith_lm import BUILT_FILES, check, main

    result = check(ARITH, keep=tmp_path / "lm", steps=3, eval_rows=0, verbose=False)
    verdicts = {p: v for p, v, _ in result.rows}
    assert set(verdicts) == set(BUILT_FILES) and not result.ok
    assert {p for p, v in verdicts.items() if v not in PASSING} == {"model.safetensors", "build_metrics.json"}
    record = json.loads((tmp_path / "lm" / "build_metrics.json").read_text())
    shipped = json.loads((ARITH / "build_metrics.json").read_text())
    arguments = ("seed", "batch_size", "lr", "warmup", "num_threads", "carry_drop")  # taken from the shipped record
    assert record["steps"] == 3 and all(record[k] == shipped[k] for k in arguments)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "check" in capsys.readouterr().out


def test_the_arith_build_command_runs_itself_with_the_portable_kernels(tmp_path, monkeypatch):
    """``build`` from a process without them starts itself again with them set, and the record names them; a
    ``build()`` called in this process records that it ran without them."""
    from tools.asset_check import PORTABLE_KERNELS, portable_kernels
    from tools.build_arith_lm import build, main

    for k in PORTABLE_KERNELS:
        monkeypatch.delenv(k, raising=False)
    assert not portable_kernels()
    monkeypatch.chdir(ROOT)
    assert main(["build", "--out", str(tmp_path / "cli"), "--steps", "2", "--batch-size", "4", "--eval-rows", "0"]) == 0
    assert json.loads((tmp_path / "cli" / "build_metrics.json").read_text())["kernels"] == PORTABLE_KERNELS
    record = build(tmp_path / "here", steps=1, batch_size=4, eval_rows=0, verbose=False)
    assert record["kernels"] == dict.fromkeys(PORTABLE_KERNELS)


@pytest.mark.slow
def test_the_arith_lm_rebuilds_bit_identically(tmp_path):
    """The whole build through its command line (560 steps on one thread and the 256-row evaluation, 2-3 min): every
    file it writes is the shipped one and the record equal but for its wall time. The command runs the build with
    the portable kernels, so this holds on any CPU with AVX2 and FMA, Intel or AMD (the asset's BUILD.md)."""
    import subprocess

    from tools.asset_check import PORTABLE_KERNELS, no_portable_kernels

    if no_portable_kernels():
        pytest.skip(no_portable_kernels())
    shipped = json.loads((ARITH / "build_metrics.json").read_text())
    assert shipped["kernels"] == PORTABLE_KERNELS  # the shipped files were built with them
    env = {k: v for k, v in os.environ.items() if k not in PORTABLE_KERNELS}  # the command sets them itself
    res = subprocess.run([sys.executable, "-m", "tools.build_arith_lm", "check", "--keep", str(tmp_path / "lm")],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    record = json.loads((tmp_path / "lm" / "build_metrics.json").read_text())
    assert record["kernels"] == PORTABLE_KERNELS and record["greedy_acc"] == shipped["greedy_acc"]


@pytest.mark.slow
def test_the_builders_run_as_modules_from_the_repository_root():
    import subprocess

    for module in ("tools.build_arith_lm", "tools.build_shapes_world", "tools.build_vlm_video"):
        res = subprocess.run([sys.executable, "-m", module, "check", "--help"], capture_output=True, text=True,
                             cwd=ROOT)
        assert res.returncode == 0 and "--keep" in res.stdout, res.stderr


def test_a_config_differing_only_in_the_library_version_stamp_passes(tmp_path):
    from tools.asset_check import EQUAL_WITHOUT_VERSIONS, compare

    for name, version, width in (("built", "5.25.0", 8), ("shipped", "5.24.0", 8)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"transformers_version": version, "width": width}))
        (tmp_path / name / "other.json").write_text(json.dumps({"transformers_version": version,
                                                                "width": width + (name == "built")}))
    rows = {p: v for p, v, _ in compare(tmp_path / "built", tmp_path / "shipped").rows}
    assert rows == {"config.json": EQUAL_WITHOUT_VERSIONS, "other.json": "DIFFERENT"}


@pytest.mark.slow
def test_the_motion_world_build_writes_the_shipped_folder_layout(tmp_path):
    """Wiring only (a few steps, not the shipped 1,500 + 600 + 6,000, ~25 s): every file the build writes is a shipped
    one, those that do not depend on training (pipeline index, scheduler, tokenizer, the model configs) identical; the
    full check is ``python -m tools.build_motion_world check`` (~25 min)."""
    from tools.asset_check import PASSING, compare
    from tools.build_motion_world import BUILT_FILES, KEYS, build
    from unialign.embedded.motion_world import WAN_DIR

    record = build(tmp_path / "wan", vae_frame_steps=2, vae_steps=2, steps=2, per_prompt=1, eval_samples=0,
                   decoder_steps=2, verbose=False)
    result = compare(tmp_path / "wan", WAN_DIR, BUILT_FILES)
    verdicts = {p: v for p, v, _ in result.rows}
    assert "not rebuilt" not in verdicts.values() and "not shipped" not in verdicts.values(), result.table()
    assert {p for p, v in verdicts.items() if v not in PASSING} == {
        "transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
        "vae/diffusion_pytorch_model.safetensors", "vae/config.json", "build_metrics.json"}, result.table()
    shipped = json.loads((WAN_DIR / "build_metrics.json").read_text())
    assert set(KEYS) <= set(shipped) and record["parameters"] == shipped["parameters"]


def test_the_motion_world_fidelity_spreads_its_prompts_over_the_split():
    """The split's order is shape-major (all circles first): the build's fidelity measures every shape."""
    from tools.build_motion_world import spread
    from unialign.embedded import motion_world

    prompts = motion_world.prompts("train")
    chosen = spread(prompts, 96)
    assert len(chosen) == len(set(chosen)) == 96
    shapes = [motion_world.parse_motion_prompt(p)[0] for p in chosen]
    assert set(shapes) == set(motion_world.SHAPES) and all(31 <= shapes.count(s) <= 33 for s in motion_world.SHAPES)
    assert spread(prompts[:5], 7) == prompts[:5] + prompts[:2]


def test_the_motion_worlds_object_mask_marks_the_latents_the_causal_vae_puts_the_object_in():
    """Frame 0 alone, then frames (1, 2) and (3, 4), each latent a 4 x 4 cell; an independent reading of one-pixel
    objects against the VAE's own layout."""
    import torch

    from tools.build_motion_world import object_latent_mask

    clips = torch.full((2, 3, 5, 32, 32), -0.5)
    clips[0, :, 0, 9, 30] = 0.7    # frame 0 -> latent frame 0, cell (2, 7)
    clips[0, :, 2, 0, 4] = 0.7     # frame 2 -> latent frame 1, cell (0, 1)
    clips[1, 0, 3, 31, 31] = 0.0   # frame 3 -> latent frame 2, cell (7, 7); one channel off is enough
    mask = object_latent_mask(clips)
    assert mask.shape == (2, 1, 3, 8, 8) and mask.dtype == torch.bool
    assert sorted(map(tuple, mask.nonzero().tolist())) == [(0, 0, 0, 2, 7), (0, 0, 1, 0, 1), (1, 0, 2, 7, 7)]
    assert not object_latent_mask(torch.full((1, 3, 5, 32, 32), 0.3)).any()  # no object, no mask


def test_the_motion_worlds_weighted_flow_loss_against_hand_computed_values():
    import torch

    from tools.build_motion_world import flow_loss

    pred, target = torch.zeros(1, 2, 1, 1, 2), torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 2, 1, 1, 2)
    mask = torch.tensor([True, False]).view(1, 1, 1, 1, 2)  # the first latent (1 and 3 in its two channels)
    assert flow_loss(pred, target) == torch.tensor((1 + 4 + 9 + 16) / 4)
    assert flow_loss(pred, target, mask, 1.0) == flow_loss(pred, target)
    assert torch.isclose(flow_loss(pred, target, mask, 5.0), torch.tensor((5 * 1 + 4 + 5 * 9 + 16) / 4))


def test_the_motion_worlds_label_noise_swaps_left_and_right_only_and_is_fixed_per_clip():
    from tools.build_motion_world import noisy_captions
    from unialign.embedded import motion_world

    data = motion_world.clip_dataset("train", per_prompt=2, seed=0)
    noisy = noisy_captions(data, 0.8, seed=0)
    assert noisy == noisy_captions(data, 0.8, seed=0) and noisy != noisy_captions(data, 0.8, seed=1)
    assert noisy_captions(data, 0.0, seed=0) == [d["prompt"] for d in data]
    swapped = {"left": 0, "right": 0}
    for d, caption in zip(data, noisy):
        true, got = motion_world.parse_motion_prompt(d["prompt"]), motion_world.parse_motion_prompt(caption)
        assert true[:3] == got[:3]  # shape, colour, background untouched
        if true[3] in ("up", "down"):
            assert got[3] == true[3]
        else:
            swapped[true[3]] += got[3] != true[3]
            assert got[3] in ("left", "right")
    n = {k: sum(motion_world.parse_motion_prompt(d["prompt"])[3] == k for d in data) for k in swapped}
    assert all(0.7 < swapped[k] / n[k] < 0.9 for k in swapped), (swapped, n)


def test_the_video_vlm_check_reads_the_shipped_record_and_compares_every_file_it_writes(tmp_path):
    """Wiring only (2 + 2 steps, not the shipped 800 + 800): the tokenizer, processor and configs are the shipped ones
    (they do not depend on training), the weights and the record are not; the full check is ``python -m
    tools.build_vlm_video check`` (~8 min)."""
    from tools.asset_check import PASSING
    from tools.build_vlm_video import BUILT_FILES, RECORD_KEYS, check
    from unialign.embedded.vlm_video import VLM_VIDEO_DIR

    result = check(VLM_VIDEO_DIR, keep=tmp_path / "v", steps=2, vision_steps=2, eval_rows=None, verbose=False)
    verdicts = {p: v for p, v, _ in result.rows}
    assert set(verdicts) == set(BUILT_FILES) and not result.ok
    assert {p for p, v in verdicts.items() if v not in PASSING} == {"model.safetensors", "build_metrics.json"}
    record = json.loads((tmp_path / "v" / "build_metrics.json").read_text())
    shipped = json.loads((VLM_VIDEO_DIR / "build_metrics.json").read_text())
    assert record["steps"] == 2 and all(record[k] == shipped[k] for k in RECORD_KEYS if k not in ("steps", "vision_steps"))
    assert record["source_sha256"] == shipped["source_sha256"]  # built from the shipped image VLM
