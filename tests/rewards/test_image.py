"""Image rewards: JPEG sizes, the LAION head layout and arithmetic, the pinned CLIP preprocessing, the
embedded CLIP-based rewards, and fast offline failure of the Hub-backed ones."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from PIL import Image

from unialign.embedded.shapes_world import aesthetic_reward, clip_score_reward, reward_kwargs
from unialign.rewards import get_reward
from unialign.rewards.image import (
    AestheticMLP,
    AestheticReward,
    ClipScoreReward,
    JpegCompressibilityReward,
    JpegIncompressibilityReward,
    clip_preprocess,
    to_pil_images,
)

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


pytestmark = pytest.mark.usefixtures("one_thread")


def _flat_and_noise(size: int = 64) -> tuple[Image.Image, Image.Image]:
    rng = np.random.default_rng(0)
    flat = Image.new("RGB", (size, size), (200, 40, 40))
    noise = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    return flat, noise


def _pattern(width: int = 300, height: int = 250) -> Image.Image:
    """A fixed, non-symmetric synthetic image (gradients + a stripe) so crop offsets matter."""
    yy, xx = np.mgrid[0:height, 0:width]
    arr = np.stack([(xx * 255 // (width - 1)), (yy * 255 // (height - 1)), ((xx // 7 + yy // 5) % 2) * 200 + 20], -1)
    arr[100:120, :] = (250, 250, 0)
    return Image.fromarray(arr.astype(np.uint8))


# ----------------------------------------------------------------------------------------- JPEG
def test_jpeg_flat_image_is_more_compressible_than_noise():
    flat, noise = _flat_and_noise()
    comp = JpegCompressibilityReward()(prompts=["", ""], completions=[flat, noise])
    incomp = JpegIncompressibilityReward()(prompts=["", ""], completions=[flat, noise])
    assert comp[0] > comp[1]
    assert incomp == [-c for c in comp]
    assert all(c < 0 for c in comp)


def test_jpeg_size_is_kilobytes_of_the_pil_jpeg():
    import io

    _, noise = _flat_and_noise()
    buffer = io.BytesIO()
    noise.save(buffer, format="JPEG", quality=80)
    assert JpegIncompressibilityReward(quality=80)(completions=[noise]) == [len(buffer.getvalue()) / 1000.0]


def test_jpeg_accepts_uint8_and_float_tensors_like_pil():
    flat, noise = _flat_and_noise()
    u8 = torch.from_numpy(np.stack([np.asarray(flat), np.asarray(noise)])).permute(0, 3, 1, 2)
    reward = JpegIncompressibilityReward()
    expected = reward(completions=[flat, noise])
    assert reward(completions=u8) == expected
    assert reward(completions=u8.float() / 255.0) == expected


def test_jpeg_rewards_are_registered():
    flat, noise = _flat_and_noise()
    rf = get_reward("jpeg_compressibility", quality=50)
    scores = rf.score(["p", "q"], [flat, noise])
    assert rf.name == "jpeg_compressibility" and scores.shape == (2,) and scores[0] > scores[1]
    assert get_reward("jpeg_incompressibility").score(["p", "q"], [flat, noise])[1] > 0


# ----------------------------------------------------------------------------------------- LAION head
def test_aesthetic_mlp_state_dict_matches_the_published_checkpoint():
    """sac+logos+ava1-l14-linearMSE.pth has exactly these keys and shapes (Linear/Dropout interleaved,
    no activations, so the Linear layers sit at indices 0, 2, 4, 6, 7)."""
    shapes = {k: tuple(v.shape) for k, v in AestheticMLP(768).state_dict().items()}
    assert shapes == {
        "layers.0.weight": (1024, 768), "layers.0.bias": (1024,),
        "layers.2.weight": (128, 1024), "layers.2.bias": (128,),
        "layers.4.weight": (64, 128), "layers.4.bias": (64,),
        "layers.6.weight": (16, 64), "layers.6.bias": (16,),
        "layers.7.weight": (1, 16), "layers.7.bias": (1,),
    }
    assert [type(m).__name__ for m in AestheticMLP(8).layers] == [
        "Linear", "Dropout", "Linear", "Dropout", "Linear", "Dropout", "Linear", "Linear"]
    assert [m.p for m in AestheticMLP(8).layers if isinstance(m, torch.nn.Dropout)] == [0.2, 0.2, 0.1]


def test_aesthetic_head_on_known_embedding_equals_hand_computation():
    torch.manual_seed(0)
    head = AestheticMLP(6).eval()
    sd = {k: v.double().numpy() for k, v in head.state_dict().items()}
    x = np.array([[0.5, -0.5, 0.5, -0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    h = x
    for i in (0, 2, 4, 6, 7):  # affine maps only, dropout is the identity in eval mode
        h = h @ sd[f"layers.{i}.weight"].T + sd[f"layers.{i}.bias"]
    out = head(torch.tensor(x, dtype=torch.float32)).detach().double().numpy()
    np.testing.assert_allclose(out, h, rtol=1e-5, atol=1e-6)
    # it is one affine map: head(x) = w . x + c
    w = sd["layers.0.weight"].T @ sd["layers.2.weight"].T @ sd["layers.4.weight"].T @ sd["layers.6.weight"].T @ sd["layers.7.weight"].T
    np.testing.assert_allclose(out[1] - out[0], (x[1] - x[0]) @ w, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------- preprocessing
def _hand_preprocess(image: Image.Image, size: int) -> np.ndarray:
    """Shortest side -> size (PIL bicubic), centre crop, /255, CLIP mean/std; float64 [3, size, size]."""
    w, h = image.size
    scale = size / min(w, h)
    new_w, new_h = (size, int(h * scale)) if w <= h else (int(w * scale), size)
    resized = np.asarray(image.resize((new_w, new_h), Image.BICUBIC), dtype=np.float64) / 255.0
    top, left = round((new_h - size) / 2), round((new_w - size) / 2)
    crop = resized[top:top + size, left:left + size]
    return ((crop - np.array(OPENAI_MEAN)) / np.array(OPENAI_STD)).transpose(2, 0, 1)


@pytest.mark.parametrize("width,height", [(300, 250), (250, 301), (224, 224)])
def test_clip_preprocess_is_pinned(width, height):
    image = _pattern(width, height)
    got = clip_preprocess([image], 224, OPENAI_MEAN, OPENAI_STD)
    assert got.shape == (1, 3, 224, 224) and got.dtype == torch.float32
    np.testing.assert_allclose(got[0].double().numpy(), _hand_preprocess(image, 224), atol=1e-5, rtol=0)


def test_clip_preprocess_matches_open_clip_eval_transform():
    import open_clip

    image = _pattern()
    ref = open_clip.image_transform(224, is_train=False, mean=OPENAI_MEAN, std=OPENAI_STD,
                                    resize_mode="shortest", interpolation="bicubic")(image)
    got = clip_preprocess([image], 224, OPENAI_MEAN, OPENAI_STD)[0]
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_tensor_inputs_are_rounded_to_8_bits_like_pil():
    image = _pattern(40, 36)
    u8 = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]
    noisy_float = u8.double() / 255.0 + 1e-4  # rounds back to the same bytes
    for x in (u8, noisy_float):
        assert np.array_equal(np.asarray(to_pil_images(x)[0]), np.asarray(image))
    assert torch.equal(clip_preprocess(u8, 32), clip_preprocess([image], 32))


# ----------------------------------------------------------------------------------------- embedded CLIP rewards
@pytest.fixture(scope="module")
def shapes():
    from unialign.embedded.shapes_world import shape_dataset

    data = shape_dataset("test", per_prompt=1, seed=123)[:6]
    return [d.image for d in data], [d.prompt for d in data]


@pytest.fixture(scope="module")
def aesthetic():
    return aesthetic_reward(device="cpu")


def test_embedded_aesthetic_feeds_the_pinned_tensor_to_the_image_encoder(aesthetic, shapes):
    images, _ = shapes
    seen = []
    encode = aesthetic.model.encode_image

    def spy(x):
        seen.append(x.clone())
        return encode(x)

    aesthetic.model.encode_image = spy
    try:
        aesthetic(completions=images)
    finally:
        del aesthetic.model.encode_image
    expected = np.stack([_hand_preprocess(im, 32) for im in images])
    np.testing.assert_allclose(torch.cat(seen).double().numpy(), expected, atol=1e-5, rtol=0)


def test_embedded_aesthetic_returns_finite_batch_for_every_input_type(aesthetic, shapes):
    images, prompts = shapes
    scores = aesthetic(prompts=prompts, completions=images)
    assert len(scores) == len(images) and all(math.isfinite(s) for s in scores)
    as_float = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1) for im in images]).float() / 255.0
    np.testing.assert_allclose(aesthetic(completions=as_float), scores, rtol=1e-5, atol=1e-6)
    # batching does not change the result
    small = aesthetic_reward(device="cpu", batch_size=4)
    np.testing.assert_allclose(small(completions=images), scores, rtol=1e-5, atol=1e-6)


def test_embedded_aesthetic_tracks_the_gold_score_on_degraded_images(aesthetic):
    from unialign.embedded.shapes_world import degrade, gold_score, shape_dataset, to_tensor

    x = to_tensor([d.image for d in shape_dataset("test", per_prompt=2, seed=7)])
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([x, degrade(x, "faded", torch.full((len(x),), 0.9), gen),
                   degrade(x, "blurry", torch.full((len(x),), 1.0), gen)])
    pred = torch.tensor(aesthetic(completions=x))
    assert torch.corrcoef(torch.stack([pred, gold_score(x)]))[0, 1] > 0.7


def test_embedded_clip_score_definitions_and_caption_matching(shapes):
    images, prompts = shapes
    score = clip_score_reward(device="cpu")(prompts=prompts, completions=images)
    cosine = clip_score_reward(device="cpu", kind="cosine", scale=1.0)(prompts=prompts, completions=images)
    assert all(math.isfinite(s) for s in score)
    np.testing.assert_allclose(score, [2.5 * max(c, 0.0) for c in cosine], rtol=1e-5, atol=1e-6)
    reward = clip_score_reward(device="cpu")
    sim = reward.image_embeddings(images) @ reward.text_embeddings(prompts).T  # [image, caption]
    assert (sim.diag() > sim.mean(dim=1)).float().mean() >= 5 / 6


def test_image_rewards_through_the_registry(shapes):
    images, prompts = shapes
    out = get_reward("aesthetic", **reward_kwargs("aesthetic"), device="cpu").score(prompts, images)
    assert out.shape == (len(images),) and torch.isfinite(out).all()
    out = get_reward("clip_score", **reward_kwargs("clip_score"), device="cpu").score(prompts, images)
    assert out.shape == (len(images),) and torch.isfinite(out).all()


# ----------------------------------------------------------------------------------------- offline
@pytest.mark.parametrize("make", [lambda: AestheticReward(device="cpu"), lambda: ClipScoreReward(device="cpu")],
                         ids=["aesthetic", "clip_score"])
def test_hub_rewards_fail_fast_offline(make, monkeypatch):
    import unialign.hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(unialign.hub, "_hub_cached", lambda name, kind: False)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE"):
        make()
    assert time.perf_counter() - start < 5.0
