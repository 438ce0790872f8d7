"""The shape verifier: prompt parsing, its accuracy on the renderer's own images (clean and degraded),
that each part really discriminates, and adversarial inputs that must score 0 without crashing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from unialign.embedded import shapes_world as E
from unialign.embedded.shape_verifier import (
    PARTS,
    ShapePrompt,
    ShapeVerifierReward,
    parse_shape_prompt,
    verify,
)
from unialign.rewards import CombinedReward, get_reward

pytestmark = pytest.mark.usefixtures("demo_worlds")  # get_reward("shape_verifier"): registered as the scripts do


def _renders(per_prompt: int, seed: int = 0) -> tuple[list[str], list[Image.Image], list[tuple[str, str, str]]]:
    """Every (shape, colour, background) of the world, ``per_prompt`` random layouts each, every size."""
    rng = random.Random(seed)
    prompts, images, specs = [], [], []
    for spec in E.all_prompts():
        for k in range(per_prompt):
            size = list(E.SIZES)[(k + rng.randrange(3)) % 3]
            half = rng.uniform(*E.SIZES[size])
            margin = half * 1.1 + 0.02
            images.append(E.render(*spec, rng.uniform(margin, 1 - margin), rng.uniform(margin, 1 - margin), half))
            prompts.append(E.caption(*spec))
            specs.append(spec)
    return prompts, images, specs


@pytest.fixture(scope="module")
def renders():
    return _renders(per_prompt=2)


# --------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("prompt, expected", [
    ("a red circle on a blue background", ShapePrompt("red", "circle", "blue")),
    ("a large noisy green square on a black background", ShapePrompt("green", "square", "black", "large", "noisy")),
    ("a faded small yellow triangle on a purple background", ShapePrompt("yellow", "triangle", "purple", "small", "faded")),
    ("  A White Circle  on an orange background. ", ShapePrompt("white", "circle", "orange")),
    ("a dark orange square on a white background", ShapePrompt("orange", "square", "white", None, "dark")),
])
def test_parse(prompt, expected):
    assert parse_shape_prompt(prompt) == expected


@pytest.mark.parametrize("prompt", [
    "a cat", "", "a pink circle on a blue background", "a red hexagon on a blue background",
    "a red circle on a red background", "a small large red circle on a blue background",
    "a red circle on a blue", "a red circle on a blue background and a cat", None, 42,
])
def test_parse_rejects_with_the_expected_form(prompt):
    with pytest.raises(ValueError, match="shape_verifier"):
        parse_shape_prompt(prompt)


# --------------------------------------------------------------------------------------- accuracy
def test_clean_renders_of_every_prompt(renders):
    prompts, images, _ = renders
    out = verify(prompts, images)
    assert len(prompts) == 336
    assert float(out["all"].mean()) >= 0.98  # measured 1.000
    assert float(out["invalid"].sum()) == 0


def test_each_part_discriminates(renders):
    """Judged against a *random other* prompt, each part is right exactly when that attribute agrees:
    a verifier that said yes to everything (or to nothing) fails this."""
    prompts, images, specs = renders
    rng = random.Random(1)
    others = [rng.choice(E.all_prompts()) for _ in specs]
    out = verify([E.caption(*o) for o in others], images)
    for part, idx in (("shape", 0), ("colour", 1), ("background", 2)):
        expected = torch.tensor([float(s[idx] == o[idx]) for s, o in zip(specs, others)])
        agree = float((out[part] == expected).float().mean())
        assert agree >= 0.98, (part, agree)
        assert 0.0 < float(expected.mean()) < 0.6  # the check had both answers to give
    assert torch.allclose(out["score"], sum(out[p] for p in PARTS) / 3)


@pytest.mark.slow
@pytest.mark.parametrize("kind, floor", [("blurry", 0.9), ("noisy", 0.9), ("faded", 0.3)])
def test_degraded_renders(renders, kind, floor):
    """Degradation strength uniform in [0.5, 1]. Measured all-three-right: blurry 0.96-0.99, noisy
    0.98-0.99, faded 0.45-0.51 (faded colours move 40-80 % of the way to grey; the verifier reads the
    colour it sees)."""
    prompts, images, _ = renders
    gen = torch.Generator().manual_seed(0)
    strength = torch.rand(len(images), generator=gen) * 0.5 + 0.5
    degraded = E.degrade(E.to_tensor(images), kind, strength, gen)
    assert float(verify(prompts, degraded)["all"].mean()) >= floor


def test_input_formats_agree(renders):
    prompts, images, _ = renders
    prompts, images = prompts[:24], images[:24]
    pil = verify(prompts, images)["score"]
    x = E.to_tensor(images)
    assert torch.equal(verify(prompts, x)["score"], pil)                                    # float [B,3,H,W]
    assert torch.equal(verify(prompts, (x * 255).round().to(torch.uint8))["score"], pil)  # uint8 tensor
    assert torch.equal(verify(prompts, [np.asarray(im) for im in images])["score"], pil)  # HWC uint8 arrays
    big = [im.resize((96, 96), Image.NEAREST) for im in images]                            # larger square: resized
    assert float((verify(prompts, big)["score"] == pil).float().mean()) >= 0.9


# --------------------------------------------------------------------------------------- adversarial
def _adversarial() -> dict[str, object]:
    rng = np.random.default_rng(0)
    red_on_blue = E.render("circle", "red", "blue", 0.5, 0.5, 0.3)
    return {
        "blank in the right background colour": Image.new("RGB", (32, 32), E.COLOURS["blue"]),
        "blank black": Image.new("RGB", (32, 32)),
        "uniform noise": Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)),
        "noise tensor": torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0)),
        "non-square": red_on_blue.resize((32, 24)),
        "too small": red_on_blue.resize((8, 8)),
        "greyscale PIL": red_on_blue.convert("L"),
        "one-channel tensor": torch.rand(1, 32, 32),
        "NaN tensor": torch.full((3, 32, 32), float("nan")),
        "inf in a tensor": E.to_tensor([red_on_blue])[0].index_put_((torch.tensor(0), torch.tensor(3), torch.tensor(3)),
                                                                   torch.tensor(float("inf"))),
        "four channels": torch.rand(4, 32, 32),
        "a string": "not an image",
    }


@pytest.mark.parametrize("name", list(_adversarial()))
def test_adversarial_inputs_score_zero(name):
    image = _adversarial()[name]
    if name == "a string":
        image = np.asarray(image)
    reward = ShapeVerifierReward()
    scores = reward(prompts=["a red circle on a blue background"], completions=[image])
    assert scores == [0.0]


def test_many_noise_images_score_zero():
    rng = np.random.default_rng(1)
    noise = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(40)]
    prompts = [E.caption(*E.all_prompts()[i * 4]) for i in range(40)]
    assert float(verify(prompts, noise)["score"].max()) == 0.0


def test_unparseable_prompt_scores_zero_and_the_loop_goes_on(caplog):
    image = E.render("circle", "red", "blue", 0.5, 0.5, 0.3)
    reward = get_reward("shape_verifier")
    scores = reward(prompts=["a cat", "a red circle on a blue background"], completions=[image, image])
    assert scores == [0.0, 1.0]
    assert "cannot parse" in caplog.text
    with pytest.raises(ValueError, match="cannot parse"):
        verify(["a cat"], [image])


def test_metrics_reach_combined_reward(renders):
    prompts, images, _ = renders
    wrong = ["a green triangle on a white background"] * 4
    out = CombinedReward([get_reward("shape_verifier")])(prompts[:4] + wrong, images[:4] + images[:4])
    m = out.function_metrics
    assert m["shape_verifier/fidelity"] == pytest.approx(0.5)
    assert set(m) == {f"shape_verifier/{k}" for k in ("fidelity", *PARTS, "invalid")}
    assert out.metrics()["rewards/shape_verifier/fidelity"] == pytest.approx(0.5)
