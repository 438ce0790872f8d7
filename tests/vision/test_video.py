"""Video inputs for ``VisionLanguagePolicy`` on tiny random-weight Qwen2-VL / Qwen2.5-VL models built in code: TRL-style
``video`` / ``videos`` rows (frame lists, a video file decoded with PyAV), mixed with image and text-only rows, the
per-row checks before any model runs, log-probs under left padding, micro-batching and the prefix pass equal to an
independent per-sample forward, a prompt limit that never cuts video tokens, a family without video refused."""

from __future__ import annotations

import random

import pytest
import torch

from tests.vision.test_policy import _reference_logp  # the per-sample forward, images and videos
from tests.vision.tiny import build, random_image
from unialign.errors import UserError
from unialign.types import Trajectory
from unialign.vision import VideoSampling, VisionLanguagePolicy, load_video, multimodal_prompt, vision_rows
from unialign.vision.media import prompt_videos

VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def _clip(rng: random.Random, frames: int = 4, size=(32, 32)) -> list:
    return [random_image(rng, size) for _ in range(frames)]


def _prompts(seed: int = 0) -> list:
    """A video row, a video + image row (a ``<video>`` placeholder in a string prompt), an image row, a text-only
    row; each twice (a group of 2)."""
    rng = random.Random(seed)
    rows = vision_rows([
        {"prompt": [{"role": "user", "content": "Which way does it move?"}], "video": _clip(rng)},
        {"prompt": "Compare <video> with <image>, briefly", "videos": [_clip(rng, 2, (32, 40))],
         "image": random_image(rng, (32, 32))},
        {"prompt": [{"role": "user", "content": "What colour?"}], "image": random_image(rng, (40, 32))},
        {"prompt": [{"role": "user", "content": "no media here"}]},
    ], "data")
    return [r["prompt"] for r in rows for _ in range(2)]


def _policy(family: str, **kw) -> VisionLanguagePolicy:
    model, processor = build(family)
    return VisionLanguagePolicy(model, processor, max_new_tokens=5, **kw)


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_video_logprobs_match_an_independent_per_sample_forward(family):
    policy = _policy(family)
    torch.manual_seed(0)
    traj = policy.sample(_prompts())
    assert "pixel_values_videos" in traj.payload["media"][0] and "video_grid_thw" in traj.payload["media"][2]
    assert torch.allclose(policy.log_prob(traj), traj.old_logp_B_T)
    for i in range(len(traj)):
        n = int(traj.mask_B_T[i].sum())
        ref = _reference_logp(policy, traj.prompts[i], traj.payload["completion_ids"][i, :n])
        assert torch.allclose(traj.old_logp_B_T[i, :n], ref, atol=1e-5), (family, i)


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_video_micro_batches_and_the_prefix_pass_give_the_batch_logprobs(family):
    policy = _policy(family)
    torch.manual_seed(1)
    traj = policy.sample(_prompts(1))
    full = policy.log_prob(traj)
    policy.share_prompt_prefix = False
    assert torch.allclose(full, policy.log_prob(traj), atol=1e-5)
    parts = [traj.select([5, 0, 3]), traj.select([7]), traj.select([1, 2, 4, 6])]
    joined = policy.log_prob(Trajectory.cat(parts))
    assert torch.allclose(joined[:, :full.shape[1]], full[[5, 0, 3, 7, 1, 2, 4, 6]], atol=1e-5)


def test_rows_are_checked_before_any_model_runs(tmp_path):
    rng = random.Random(0)
    with pytest.raises(UserError, match=r"data row 1: the prompt has 2 video placeholder\(s\) but the row has 1"):
        vision_rows([{"prompt": "ok"}, {"prompt": "<video> then <video>?", "video": _clip(rng)}], "data")
    with pytest.raises(UserError, match="data row 0: has both 'video' and 'videos'"):
        vision_rows([{"prompt": "x", "video": _clip(rng), "videos": [_clip(rng)]}], "data")
    with pytest.raises(UserError, match=r"data row 0: field 'video': a video needs at least one frame"):
        vision_rows([{"prompt": "x", "video": []}], "data")
    with pytest.raises(UserError, match=r"data row 0: field 'video'\[1\]: no image file at 'missing.png'"):
        vision_rows([{"prompt": "x", "video": [random_image(rng), "missing.png"]}], "data", base_dir=tmp_path)
    with pytest.raises(UserError, match="a video is a list of frames or a video file"):
        vision_rows([{"prompt": "x", "video": 3}], "data")
    # frames as relative paths, placed first in the first user message when the prompt has no video block
    for k in range(3):
        random_image(rng).save(tmp_path / f"f{k}.png")
    (row,) = vision_rows([{"prompt": [{"role": "user", "content": "move?"}], "video": ["f0.png", "f1.png", "f2.png"],
                           "answer": "left"}], "data", base_dir=tmp_path)
    assert row["answer"] == "left" and [b["type"] for b in row["prompt"][0]["content"]] == ["video", "text"]
    assert len(prompt_videos(row["prompt"])[0]) == 3
    # a video row for a family that takes none is refused naming the row
    idefics = _policy("idefics3")
    with pytest.raises(UserError, match="prompt row 0: holds 1 video"):
        idefics.sample([row["prompt"]])


def test_frames_are_sampled_to_max_frames_evenly():
    rng = random.Random(0)
    clip = _clip(rng, 9)
    got = load_video(clip, sampling=VideoSampling(max_frames=3))
    assert [clip.index(f) for f in got] == [0, 4, 8]
    assert len(load_video(clip, sampling=VideoSampling(max_frames=None))) == 9
    with pytest.raises(ValueError, match="max_frames"):
        VideoSampling(max_frames=0)
    with pytest.raises(ValueError, match="video_fps"):
        VideoSampling(fps=0)


def test_a_video_file_is_decoded_at_the_asked_fps(tmp_path):
    av = pytest.importorskip("av")
    import numpy as np

    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as container:  # 12 frames at 6 fps: two seconds, each frame its own grey level
        stream = container.add_stream("mpeg4", rate=6)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for k in range(12):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 20 * k, dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    every = load_video(str(path), sampling=VideoSampling(max_frames=None))
    assert len(every) == 12 and every[0].size == (32, 32)
    two = load_video("clip.mp4", tmp_path, sampling=VideoSampling(fps=2.0, max_frames=None))
    assert len(two) == 4  # 2 seconds at 2 fps
    levels = [int(np.asarray(f).mean()) for f in two]
    assert levels == sorted(levels) and abs(levels[1] - 60) <= 8  # frames 0, 3, 6, 9
    (row,) = vision_rows([{"prompt": "<video> which way?", "video": "clip.mp4"}], "data", base_dir=tmp_path,
                         video=VideoSampling(max_frames=4))
    assert len(prompt_videos(row["prompt"])[0]) == 4
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all")
    with pytest.raises(UserError, match="broken.mp4 is not a readable video"):
        load_video("broken.mp4", tmp_path)


def test_a_prompt_limit_never_cuts_video_tokens():
    rng = random.Random(0)
    prompt = multimodal_prompt([{"role": "user", "content": "Which way?"}], [], videos=[_clip(rng)])
    policy = _policy("qwen2_vl", max_prompt_length=20)  # 32 video tokens + the template: over 20
    with pytest.raises(UserError, match=r"prompt row 0: \d+ tokens \(32 of them image / video tokens\) > "
                                        r"max_prompt_length=20.*--max_frames"):
        policy.sample([prompt])
    assert policy.count_prompt_tokens([prompt], 20)[0] > 32  # the video's tokens are counted, never cut


def test_a_video_file_over_the_pixel_limit_is_refused(tmp_path):
    av = pytest.importorskip("av")
    import numpy as np

    from unialign.images import ImageRules

    path = tmp_path / "big.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for k in range(6):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.full((64, 64, 3), 30 * k, np.uint8), "rgb24")))
        container.mux(stream.encode())
    with pytest.raises(UserError, match=r"64 x 64 frames, over the image limit of 1000 pixels"):
        load_video(str(path), rules=ImageRules(tmp_path, max_pixels=1000))
    thinned = load_video(str(path), sampling=VideoSampling(max_frames=2))
    levels = [int(np.asarray(f).mean()) for f in thinned]
    assert len(thinned) == 2 and levels[0] < 20 and levels[1] > 130  # the first and the last frame
