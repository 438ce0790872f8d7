"""Video rewards: an image reward per frame reduced per video (against the frames scored one by one), the
temporal-consistency term against a hand computation, the forms a video may take, and the registry entries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from unialign.rewards import get_reward
from unialign.rewards.registry import rewards_for
from unialign.rewards.video import PerFrameReward, TemporalConsistencyReward, batch_videos


def brightness(prompts=None, completions=None, offset=None, **_):
    """A TRL-signature image reward reading a per-row column: mean brightness in [0, 1] plus the row's offset."""
    return [float(np.asarray(im).mean() / 255) + (offset[i] if offset else 0.0) for i, im in enumerate(completions)]


def _grey(level: int) -> Image.Image:
    return Image.new("RGB", (8, 8), (level, level, level))


def test_per_frame_reward_reduces_each_video_and_repeats_its_columns():
    videos = [[_grey(0), _grey(255)], [_grey(51), _grey(102), _grey(153)]]
    mean = PerFrameReward(brightness)(prompts=["a", "b"], completions=videos, offset=[0.0, 1.0])
    assert mean == pytest.approx([0.5, 1.0 + 0.4])  # the second video's column added to each of its frames
    worst = PerFrameReward(brightness, reduction="min")(prompts=["a", "b"], completions=videos, offset=[0.0, 1.0])
    assert worst == pytest.approx([0.0, 1.2])
    nan = PerFrameReward(lambda prompts, completions, **_: [1.0, None, 1.0])(prompts=["a", "b"], completions=[
        [_grey(0)], [_grey(0), _grey(0)]])
    assert nan[0] == 1.0 and math.isnan(nan[1])
    with pytest.raises(ValueError, match="reduction"):
        PerFrameReward(brightness, reduction="median")


def test_per_frame_reward_by_name_matches_the_image_reward_frame_by_frame():
    jpeg = get_reward("jpeg_compressibility")
    frames = [Image.fromarray(np.random.default_rng(k).integers(0, 255, (16, 16, 3), dtype=np.uint8))
              for k in range(4)]
    per_frame = get_reward("per_frame", reward="jpeg_compressibility")
    got = per_frame(prompts=["x", "y"], completions=[frames[:3], frames[3:]])
    one = [jpeg(prompts=["x"], completions=[f])[0] for f in frames]
    assert got == pytest.approx([sum(one[:3]) / 3, one[3]])


def test_temporal_consistency_pixel():
    still = [_grey(100)] * 3
    flicker = [_grey(0), _grey(255), _grey(0)]
    ramp = [_grey(0), _grey(51), _grey(102)]
    scores = TemporalConsistencyReward()(completions=[still, flicker, ramp, [_grey(7)]])
    assert scores == pytest.approx([1.0, 0.0, 0.8, 1.0])
    as_tensor = torch.stack([torch.full((3, 8, 8), v / 255) for v in (0, 51, 102)])[None]  # [B, F, C, H, W]
    assert TemporalConsistencyReward()(completions=as_tensor) == pytest.approx([0.8], abs=1e-6)


def test_temporal_consistency_clip_on_the_embedded_clip():
    from unialign.embedded.shapes_world import load_embedded_clip, render

    clip = load_embedded_clip()
    same = [render("circle", "red", "blue", 0.5, 0.5, 0.3)] * 2
    other = [render("circle", "red", "blue", 0.5, 0.5, 0.3), render("square", "green", "white", 0.5, 0.5, 0.3)]
    s_same, s_other = TemporalConsistencyReward("clip", clip=clip)(completions=[same, other])
    assert s_same == pytest.approx(1.0, abs=1e-5) and s_other < s_same


def test_video_forms_and_the_registry():
    arr = np.zeros((2, 3, 4, 4), dtype=np.uint8)
    assert [len(v) for v in batch_videos([arr, [arr[0]]])] == [2, 1]
    with pytest.raises(ValueError, match="at least one frame"):
        batch_videos([[]])
    with pytest.raises(ValueError, match=r"\[B, F, C, H, W\]"):
        batch_videos(torch.zeros(2, 3, 4, 4))
    assert {"per_frame", "temporal_consistency"} <= set(rewards_for("video"))
    assert "per_frame" not in rewards_for("image")


def test_pairwise_win_rates_over_videos():
    still, ramp, flicker = [_grey(100)] * 3, [_grey(0), _grey(51), _grey(102)], [_grey(0), _grey(255), _grey(0)]
    reward = get_reward("pairwise", score="temporal_consistency")
    wins = reward(prompts=["p"] * 3, completions=[still, ramp, flicker])
    assert wins == pytest.approx([1.0, 0.5, 0.0])  # consistency 1 > 0.8 > 0: win rates within the group
