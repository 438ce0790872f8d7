"""The second fidelity reader of the shapes world (``unialign.embedded.shape_reader``): it passes the world's clean
renders of prompts and layouts it was not built on, fails what is not the prompt (a blank canvas, noise, another
shape or colour), refuses prompts of another world, and reaches every image summary through ``fidelity_checks``;
the builder's wiring (``tools.build_shape_reader``: a short build writes the shipped files' names, the config
identical)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from unialign.embedded import shapes_world as world
from unialign.embedded.shape_reader import PARTS, SHAPE_CLASSES, ShapeReader, labels, shipped_reader

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def held_out():
    data = world.shape_dataset("test", per_prompt=4, seed=77)  # a layout seed the build never drew
    return [d.prompt for d in data], [d.image for d in data], data


def test_clean_renders_of_held_out_prompts_pass(held_out):
    prompts, images, _ = held_out
    reading = shipped_reader().read(prompts, images)
    assert set(reading) == {*PARTS, "all"}
    assert float(reading["background"].mean()) == 1.0 and float(reading["colour"].mean()) == 1.0
    assert float(reading["all"].mean()) >= 0.93  # the build record: 0.99 on every prompt at another seed
    probs = shipped_reader().probabilities(images)
    assert probs["shape"].shape == (len(images), len(SHAPE_CLASSES))
    torch.testing.assert_close(probs["shape"].sum(-1), torch.ones(len(images)))


def test_what_is_not_the_prompt_fails(held_out):
    prompts, images, data = held_out
    reader = shipped_reader()
    blanks = [Image.new("RGB", (32, 32), world.COLOURS[d.background]) for d in data]
    blank = reader.read(prompts, blanks)
    assert float(blank["shape"].max()) == 0.0 and float(blank["all"].max()) == 0.0  # "none", not a square
    assert float(blank["background"].mean()) == 1.0  # the canvas colour is still read
    noise = torch.rand(len(prompts), 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert float(reader.read(prompts, noise)["all"].mean()) <= 0.02
    other_shape = [p.replace(d.shape, world.SHAPES[(world.SHAPES.index(d.shape) + 1) % 3]) for p, d in zip(prompts, data)]
    assert float(reader.read(other_shape, images)["shape"].mean()) <= 0.05
    names = list(world.COLOURS)
    swapped = [world.caption(d.shape, next(c for c in names if c not in (d.colour, d.background)), d.background)
               for d in data]
    assert float(reader.read(swapped, images)["colour"].mean()) <= 0.05


def test_prompts_of_another_world_are_refused():
    assert labels("a red circle on a blue background") == {"shape": 0, "colour": 0, "background": 2}
    with pytest.raises(ValueError):
        labels("a photo of a cat")


def test_fidelity_checks_carry_the_reading_beside_the_verifier(held_out):
    from unialign.embedded.parts import fidelity_checks

    prompts, images, _ = held_out
    checks = fidelity_checks(prompts[:4], images[:4])
    assert {"all", "credit", "shape", "reader", "reader_shape", "reader_colour", "reader_background"} <= set(checks)
    assert checks["reader"].shape == (4,)


def test_the_builder_writes_the_shipped_files(tmp_path):
    from tools.build_shape_reader import BUILT_FILES, build
    from unialign.embedded.shape_reader import READER_DIR

    metrics = build(tmp_path, steps=2, per_prompt=1, verbose=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(BUILT_FILES)
    assert (tmp_path / "config.json").read_bytes() == (READER_DIR / "config.json").read_bytes()
    shipped = json.loads((READER_DIR / "build_metrics.json").read_text())
    assert metrics["steps"] == 2 and shipped["steps"] == 3000 and shipped["held_out_layouts"]["clean"]["all"] >= 0.98
    assert ShapeReader(tmp_path).confidence == 0.9  # the short build loads as a reader


def test_loading_a_reader_leaves_the_global_random_state_alone():
    """An evaluation builds the reader mid-run: it must not shift the training run's random draws."""
    state = torch.random.get_rng_state()
    ShapeReader()
    assert torch.equal(torch.random.get_rng_state(), state)
