"""The motion world (``unialign.embedded.motion_world``): its prompts and split, deterministic clips that move the
way their prompt says, and the clip verifier -- right on the world's own clips, wrong on the reversed direction,
on a still clip and on an empty canvas, graded between, and scoring any other world's prompt 0."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from unialign.embedded import motion_world as world


def test_prompts_split_and_parse():
    every, train, test = world.prompts("all"), world.prompts("train"), world.prompts("test")
    assert len(every) == 3 * 8 * 7 * 4 == len(set(every)) and sorted(train + test) == sorted(every)
    assert 0.08 < len(test) / len(every) < 0.17 and not set(train) & set(test)
    assert world.parse_motion_prompt("A red circle moving left on a blue background.") == (
        "circle", "red", "blue", "left")
    for bad, match in (("a red circle on a blue background", "is not 'a <colour>"),
                       ("a red circle moving sideways on a blue background", "'sideways' is not a direction"),
                       ("a teal circle moving up on a blue background", "'teal' is not a colour")):
        with pytest.raises(ValueError, match=match):
            world.parse_motion_prompt(bad)
    with pytest.raises(ValueError, match="split must be"):
        world.prompts("dev")


def test_clips_are_deterministic_and_move_the_way_the_prompt_says():
    a = world.clip_dataset("test", per_prompt=1, seed=3)
    b = world.clip_dataset("test", per_prompt=1, seed=3)
    assert [np.asarray(f).tobytes() for f in a[0]["frames"]] == [np.asarray(f).tobytes() for f in b[0]["frames"]]
    assert all(len(d["frames"]) == world.NUM_FRAMES and d["frames"][0].size == (32, 32) for d in a)
    for direction, (ux, uy) in world.DIRECTIONS.items():
        frames = world.render_clip("bar", "white", "black", direction, random.Random(0))
        masks = [np.asarray(f, dtype=np.float32).mean(-1) > 128 for f in frames]
        centres = [np.argwhere(m).mean(0)[::-1] for m in masks]  # (x, y)
        d = centres[-1] - centres[0]
        assert d @ np.array([ux, uy]) > 8 and abs(d @ np.array([uy, ux])) < 1, (direction, d)


def test_the_shapes_differ_in_extent_and_each_is_read_as_itself_not_as_another():
    """A bar is wide, a column tall, a circle round, at equal area; the verifier's templates are this world's (the
    image world's verifier would read a bar as a square or a triangle)."""
    from unialign.embedded.shape_verifier import image_array, read_image

    for shape in world.SHAPES:
        for k in range(6):
            frame = world.render(shape, "yellow", "purple", 0.5, 0.5, 0.14 + 0.012 * k)
            mask = np.asarray(frame, dtype=np.float32)[..., 1] > 140  # yellow's green channel, not purple's
            ys, xs = np.nonzero(mask)
            width, height = np.ptp(xs) + 1, np.ptp(ys) + 1
            aspect = {"circle": (0.85, 1.2), "bar": (1.6, 3.0), "column": (0.33, 0.62)}[shape]
            assert aspect[0] < width / height < aspect[1], (shape, k, width, height)
            reading = read_image(image_array(frame), world.TEMPLATES)
            assert reading.shape == shape and reading.shape_iou > 0.85, (shape, k, reading.shape_ious)
            others = [v for s, v in reading.shape_ious.items() if s != shape]
            assert max(others) < reading.shape_iou - 0.25
    with pytest.raises(ValueError, match="unknown shape 'square'"):
        world.render("square", "red", "blue", 0.5, 0.5, 0.2)


def test_the_verifier_reads_clean_clips_right_and_catches_wrong_still_and_empty_ones():
    data = world.clip_dataset("test", per_prompt=1, seed=0)[:48]
    prompts, videos = [d["prompt"] for d in data], [d["frames"] for d in data]
    right = world.verify_clips(prompts, videos)
    assert float(right["all"].mean()) == 1.0 and float(right["credit"].mean()) > 0.9
    flip = {"left": "right", "right": "left", "up": "down", "down": "up"}
    reversed_prompts = [world.caption(*(lambda s, c, b, d: (s, c, b, flip[d]))(*world.parse_motion_prompt(p)))
                        for p in prompts]
    wrong = world.verify_clips(reversed_prompts, videos)
    assert float(wrong["direction"].sum()) == 0 and float(wrong["shape"].mean()) == 1.0
    still = world.verify_clips(prompts, [[v[0]] * len(v) for v in videos])
    assert float(still["direction"].sum()) == 0 and float(still["background"].mean()) == 1.0
    empty = world.verify_clips(prompts[:4], [[Image.new("RGB", (32, 32), (35, 70, 220))] * 9] * 4)
    assert float(empty["all"].sum()) == 0 and float(empty["credit"].max()) < 0.05
    # graded: right > reversed > still-ish, every clip
    assert (right["credit"] > wrong["credit"]).all() and (wrong["credit"] >= 0).all()


def test_the_reward_scores_other_worlds_prompts_zero_and_reports_rates():
    from unialign.embedded import register
    from unialign.rewards import get_reward
    from unialign.rewards.registry import REWARD_INPUTS

    register()
    assert REWARD_INPUTS["motion_verifier"] == REWARD_INPUTS["motion_verifier_partial"] == "video"
    data = world.clip_dataset("train", per_prompt=1, seed=0)[:3]
    prompts = [d["prompt"] for d in data] + ["a red circle on a blue background"]
    videos = [d["frames"] for d in data] + [data[0]["frames"]]
    hard = get_reward("motion_verifier").fn(prompts, videos)
    soft = get_reward("motion_verifier_partial").fn(prompts, videos)
    assert hard[:3] == [1.0, 1.0, 1.0] and hard[3] == soft[3] == 0.0
    assert all(0.9 < s <= 1.0 for s in soft[:3])
    assert hard.metrics["fidelity"] == pytest.approx(0.75) and hard.metrics["direction"] == pytest.approx(0.75)
    tensor = torch.stack([torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in v])
                          for v in videos[:3]]).float() / 255  # [B, F, 3, H, W] in [0, 1]
    assert world.verify_clips(prompts[:3], tensor)["all"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.slow
def test_grpo_video_runs_the_embedded_wan_end_to_end(tmp_path):
    """``scripts/grpo_video.py`` with its embedded default (two steps): held-out fidelity before / after in the
    summary, the frame-strip comparison, a stock ``WanPipeline`` folder in final/ that samples 5-frame clips."""
    from diffusers import WanPipeline

    from tests.test_scripts import IMAGE_SMOKE, check_summary, run

    run("grpo_video", IMAGE_SMOKE + ["--output_dir", str(tmp_path), "--report_to", "none"])
    s = check_summary(tmp_path, "reward")
    assert s["reward"] == "motion_verifier_partial" and s["config"]["model_name_or_path"] == "embedded-wan"
    assert {"fidelity_before", "fidelity_after", "fidelity_direction_before", "fidelity_direction_after"} <= set(s)
    assert s["eval_source"].startswith("held out")
    strip = Image.open(s["comparison_image"])
    assert strip.width > strip.height / 8  # clips: frames side by side
    pipe = WanPipeline.from_pretrained(str(tmp_path / "final"))
    frames = pipe(["a red circle moving left on a blue background"], num_inference_steps=3, guidance_scale=1.0,
                  height=32, width=32, num_frames=world.NUM_FRAMES, max_sequence_length=world.MAX_SEQUENCE_LENGTH,
                  output_type="np").frames
    assert frames.shape == (1, world.NUM_FRAMES, 32, 32, 3) and np.isfinite(frames).all()


def test_grpo_video_defaults_to_awm_with_its_own_knobs_and_keeps_the_measured_flow_grpo_recipe():
    """The default is AWM with its published trust region (epsilon 1, the prediction-MSE KL) and the measured KL
    of 0.03 -- not the image scripts' GRPO clip of 1e-2, which a default algorithm would otherwise inherit;
    ``--algorithm flow_grpo`` keeps the recipe measured for it (the clip 1e-2, no KL, a 3-step SDE window in 0-6)."""
    from tests.test_scripts import load_script
    from unialign.config import parse_config

    video = load_script("grpo_video")
    awm = parse_config(video.GRPOVideoConfig, []).algo_spec()
    assert (awm.name, awm.log_prob_estimator, awm.epsilon, awm.kl_estimator, awm.beta) == (
        "awm", "forward", 1.0, "prediction_mse", 0.03)
    cfg = parse_config(video.GRPOVideoConfig, ["--algorithm", "flow_grpo"])
    spec = cfg.algo_spec()
    assert (spec.log_prob_estimator, spec.epsilon, spec.beta, cfg.sde_window_size, cfg.sde_window_range) == (
        "sampler", 1e-2, 0.0, 3, "0,6")
    assert parse_config(video.GRPOVideoConfig, ["--algorithm", "flow_grpo", "--beta", "0.04"]).algo_spec().beta == 0.04


def test_a_video_model_is_refused_by_the_pair_script_and_named_wrong_prompts_before_loading(capsys):
    from tests.test_scripts import load_script
    from unialign.config import UserError, parse_config

    dpo = load_script("dpo_sdxl")
    with pytest.raises(UserError, match="'embedded-wan' makes videos; Diffusion-DPO pairs are images"):
        dpo.main(parse_config(dpo.DiffusionDPOConfig, ["--model_name_or_path", "embedded-wan"]))
    video = load_script("grpo_video")
    with pytest.raises(ValueError, match=r"prompt_set\[0\]: 'cat' is not 'a <colour> <shape> moving <direction>"):
        video.main(parse_config(video.GRPOVideoConfig, ["--prompt_set", "animals"]))


def test_the_video_comparison_puts_each_clip_over_its_after_clip_and_checks_its_inputs():
    from unialign.image.grid import make_video_comparison

    clips = [world.clip_dataset("test", per_prompt=1)[i]["frames"] for i in range(3)]
    prompts = ["p0", "p1", "p0"]  # a repeated prompt is shown once
    im = make_video_comparison(clips, clips, prompts, ["0.1 x"] * 3, ["0.9 ok"] * 3, columns=2, frame_px=40)
    strip_w = world.NUM_FRAMES * (40 + 2) - 2
    # two distinct prompts: one row of two tiles, each a before strip over an after strip with its caption
    assert 2 * strip_w < im.width < 3 * strip_w and 2 * 40 < im.height < 2 * 2 * 40
    with pytest.raises(ValueError, match="make_video_comparison: 2 before / 3 after videos for 3 prompts"):
        make_video_comparison(clips[:2], clips, prompts)
    with pytest.raises(ValueError, match="make_video_comparison: 1 after labels for 3 prompts"):
        make_video_comparison(clips, clips, prompts, after_labels=["x"])
