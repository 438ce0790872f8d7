"""GenEval scoring (``unialign.rewards.geneval``): hand-worked verdicts for every tag against GenEval's rules and
Flow-GRPO's dense variant, the metadata format and its errors, detection filtering with the published
thresholds, the CLIP colour step, and the embedded world's backend agreeing with the shape verifier."""

from __future__ import annotations

import json
import random
from collections import namedtuple

import pytest
import torch

from unialign.embedded import shapes_world as E
from unialign.embedded.geneval_shapes import shapes_metadata
from unialign.embedded.shape_verifier import verify
from unialign.rewards import CombinedReward, get_reward
from unialign.rewards.geneval import (
    COUNTING_THRESHOLD,
    MAX_OBJECTS,
    THRESHOLD,
    ClipColourClassifier,
    DetectorBackend,
    GenEvalObject,
    GenEvalReward,
    geneval_verdict,
    keep_detections,
    parse_metadata,
    relative_position,
)

pytestmark = pytest.mark.usefixtures("demo_worlds")  # get_reward("geneval", backend="shapes"): registered as the scripts do

Det = namedtuple("Det", "label score box")


def meta(tag, include, exclude=None):
    return parse_metadata({"tag": tag, "include": include, "exclude": exclude or [], "prompt": "p"}, colors=None)


def objs(*boxes_colours):
    return [GenEvalObject(box, 1.0, colour) for box, colour in boxes_colours]


def box(x, y, s=10):
    return (x, y, x + s, y + s)


def verdict(m, objects):
    r = geneval_verdict(objects, m)
    return r.correct, r.strict, round(r.score, 6)


# ------------------------------------------------------------------ every tag, by hand
def test_single_object():
    m = meta("single_object", [{"class": "cat", "count": 1}])
    assert verdict(m, {"cat": objs((box(0, 0), None))}) == (True, True, 1.0)
    assert verdict(m, {}) == (False, False, 0.0)                      # 1 - |1 - 0| / 1
    assert verdict(m, {"dog": objs((box(0, 0), None))}) == (False, False, 0.0)
    # two cats: GenEval's ">= count" holds, the strict "== count" does not; dense 1 - |1 - 2| / 1 = 0
    assert verdict(m, {"cat": objs((box(0, 0), None), (box(50, 0), None))}) == (True, False, 0.0)


def test_two_object():
    m = meta("two_object", [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}])
    assert verdict(m, {"cat": objs((box(0, 0), None)), "dog": objs((box(50, 0), None))}) == (True, True, 1.0)
    assert verdict(m, {"cat": objs((box(0, 0), None))}) == (False, False, 0.5)  # parts 1, 0


def test_counting():
    m = meta("counting", [{"class": "apple", "count": 3}], [{"class": "apple", "count": 4}])
    three = {"apple": objs(*[(box(20 * i, 0), None) for i in range(3)])}
    assert verdict(m, three) == (True, True, 1.0)
    for n, dense in ((2, 1 - 1 / 3), (4, 1 - 1 / 3), (5, 1 - 2 / 3), (7, 1 - 4 / 3)):  # 7: negative, as Flow-GRPO
        found = {"apple": objs(*[(box(20 * i, 0), None) for i in range(n)])}
        assert verdict(m, found) == (False, False, round(dense, 6)), n
    # without the exclude clause GenEval's ">=" accepts 4; the strict verdict never does
    loose = meta("counting", [{"class": "apple", "count": 3}])
    assert verdict(loose, {"apple": objs(*[(box(20 * i, 0), None) for i in range(4)])})[:2] == (True, False)


def test_colors():
    m = meta("colors", [{"class": "car", "count": 1, "color": "red"}])
    assert verdict(m, {"car": objs((box(0, 0), "red"))}) == (True, True, 1.0)
    assert verdict(m, {"car": objs((box(0, 0), "blue"))}) == (False, False, 0.5)   # count 1, colour 0
    assert verdict(m, {}) == (False, False, 0.0)                                   # count 0, then one 0
    # two cars, the more confident red: GenEval reads only the `count` most confident (True); strict needs
    # exactly one car; dense: count part 1 - 1 = 0 and one 0 for the colour it does not read
    assert verdict(m, {"car": objs((box(0, 0), "red"), (box(50, 0), "blue"))}) == (True, False, 0.0)
    assert verdict(m, {"car": objs((box(0, 0), "blue"), (box(50, 0), "red"))})[:2] == (False, False)
    two = meta("colors", [{"class": "car", "count": 2, "color": "red"}])
    assert verdict(two, {"car": objs((box(0, 0), "red"), (box(50, 0), "blue"))}) == (False, False, 0.75)  # 1, 1/2


def test_position():
    m = meta("position", [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}])
    assert verdict(m, {"dog": objs((box(100, 0), None)), "cat": objs((box(0, 0), None))}) == (True, True, 1.0)
    # cat right of the dog: parts 1 (dog), 1 (cat count), 0 (position) -- Flow-GRPO's server would give 3/4
    assert verdict(m, {"dog": objs((box(0, 0), None)), "cat": objs((box(100, 0), None))}) == (False, False,
                                                                                              round(2 / 3, 6))
    # no dog: its clause fails, so the cat has no target: parts 0, 1, 0
    assert verdict(m, {"cat": objs((box(0, 0), None))}) == (False, False, round(1 / 3, 6))
    # every cat must be left of every dog (GenEval's loop): one cat on the wrong side fails it
    m2 = meta("position", [{"class": "dog", "count": 1}, {"class": "cat", "count": 2, "position": ["left of", 0]}])
    ok = {"dog": objs((box(100, 0), None)), "cat": objs((box(0, 0), None), (box(20, 0), None))}
    bad = {"dog": objs((box(100, 0), None)), "cat": objs((box(0, 0), None), (box(200, 0), None))}
    assert verdict(m2, ok)[:2] == (True, True) and verdict(m2, bad)[:2] == (False, False)


def test_color_attr():
    m = meta("color_attr", [{"class": "bench", "count": 1, "color": "red"}, {"class": "cat", "count": 1,
                                                                              "color": "blue"}])
    good = {"bench": objs((box(0, 0), "red")), "cat": objs((box(50, 0), "blue"))}
    assert verdict(m, good) == (True, True, 1.0)
    swapped = {"bench": objs((box(0, 0), "blue")), "cat": objs((box(50, 0), "red"))}
    assert verdict(m, swapped) == (False, False, 0.5)            # parts 1, 0, 1, 0
    half = {"bench": objs((box(0, 0), "red")), "cat": objs((box(50, 0), "red"))}
    assert verdict(m, half) == (False, False, 0.75)


def test_relative_position_by_hand():
    # offset (-50, 0); each axis shrunk by 0.1 x (10 + 10) = 2: (-48, 0) / 50 -> dx -0.96
    assert relative_position(box(0, 0), box(50, 0)) == {"left of"}
    assert relative_position(box(50, 0), box(0, 0)) == {"right of"}
    assert relative_position(box(0, 0), box(0, 50)) == {"above"}          # y grows downwards
    assert relative_position(box(0, 0), box(50, 50)) == {"left of", "above"}  # (-48, -48) / 70.7: -0.68 each
    assert relative_position(box(0, 0), box(1, 1)) == set()               # within the margin on both axes
    # dx = (30 - 2) / sqrt(30^2 + 40^2) = 0.56 -> right of; dy = 38 / 50 = 0.76 -> below
    assert relative_position(box(30, 40), box(0, 0)) == {"right of", "below"}
    # dx = (10 - 2) / sqrt(10^2 + 40^2) = 0.19: below only
    assert relative_position(box(10, 40), box(0, 0)) == {"below"}


# ------------------------------------------------------------------ metadata
def test_metadata_format_round_trip_and_errors():
    row = {"tag": "position", "prompt": "a photo of a cat left of a dog",
           "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}]}
    m = parse_metadata(row)
    assert m.classes == ["dog", "cat"] and m.include[1].position == ("left of", 0)
    assert parse_metadata(m.as_row()) == m
    assert parse_metadata({**row, "include": json.dumps(row["include"])}) == m   # a flattened column
    bad = [({"tag": "pose"}, "tag 'pose'"),
           ({"include": []}, "include is empty"),
           ({"include": [{"class": "cat", "count": 0}]}, "include[0].count"),
           ({"include": [{"class": "cat", "count": True}]}, "include[0].count"),
           ({"include": [{"count": 1}]}, "include[0] needs a non-empty 'class'"),
           ({"include": [{"class": "cat", "color": "teal"}]}, "include[0].color 'teal'"),
           ({"include": [{"class": "cat", "position": ["left of", 0]}]}, "include[0].position"),
           ({"include": [{"class": "a"}, {"class": "b", "position": ["near", 0]}]}, "include[1].position"),
           ({"include": "{not json"}, "include is a string that is not JSON")]
    for change, message in bad:
        with pytest.raises(ValueError, match="row 7: " + message.replace("[", r"\[").replace("]", r"\]")):
            parse_metadata({**row, **change}, "row 7")


# ------------------------------------------------------------------ detection filtering (GenEval's constants)
def test_published_thresholds():
    assert (THRESHOLD, COUNTING_THRESHOLD, MAX_OBJECTS) == (0.3, 0.9, 16)


def test_keep_detections_thresholds_sorts_and_caps():
    dets = [Det("cat", 0.31, box(0, 0)), Det("cat", 0.3, box(1, 0)), Det("cat", 0.9, box(2, 0)),
            Det("dog", 0.99, box(3, 0)), Det("bird", 0.99, box(4, 0))]
    kept = keep_detections(dets, ["cat", "dog"], 0.3)
    assert [o.score for o in kept["cat"]] == [0.9, 0.31]          # > threshold, most confident first
    assert set(kept) == {"cat", "dog"}                             # only the queried classes
    many = [Det("cat", 0.5 + i / 100, box(i, 0)) for i in range(20)]
    assert len(keep_detections(many, ["cat"], 0.3)["cat"]) == 16


class FakeDetector:
    """Returns fixed detections and records the queries (an independent stand-in for a zero-shot model)."""

    def __init__(self, per_image):
        self.per_image, self.calls = per_image, []

    def __call__(self, images, queries, threshold=0.0):
        self.calls.append((len(images), queries, threshold))
        return [[d for d in dets if d.score > threshold] for dets in self.per_image]


def test_detector_backend_counting_threshold_and_colours():
    from PIL import Image

    red, blue = Image.new("RGB", (64, 64), (220, 30, 30)), Image.new("RGB", (64, 64), (35, 70, 220))
    colour = ClipColourClassifier(clip=E.load_embedded_clip(), colors=("red", "blue"), device="cpu")
    apples = [Det("apple", s, box(10 * i, 0)) for i, s in enumerate((0.95, 0.92, 0.5))]
    det = FakeDetector([apples, apples, [Det("car", 0.8, (0, 0, 64, 64))]])
    backend = DetectorBackend(det, colour, device="cpu")
    metas = [meta("counting", [{"class": "apple", "count": 2}]), meta("two_object", [{"class": "apple", "count": 3}]),
             meta("colors", [{"class": "car", "count": 1, "color": "red"}])]
    out = backend([red, red, red], metas)
    assert [len(o["apple"]) for o in out[:2]] == [2, 3]     # 0.9 on counting prompts, 0.3 otherwise
    assert out[0]["apple"][0].color is None                 # no clause asks for the apples' colour
    assert det.calls[0][1] == [["apple"], ["apple"], ["car"]]
    # the colour step reads the crop: the same box on a red and on a blue image
    reds = colour(red, [(0, 0, 64, 64)], "car")
    blues = colour(blue, [(0, 0, 64, 64)], "car")
    assert out[2]["car"][0].color == reds[0]
    assert len(reds) == len(blues) == 1 and reds[0] in ("red", "blue")


# ------------------------------------------------------------------ the embedded world's backend
def _renders(n_layouts=1, seed=0):
    rng = random.Random(seed)
    prompts, images = [], []
    for spec in E.all_prompts():
        for k in range(n_layouts):
            half = rng.uniform(*E.SIZES[list(E.SIZES)[k % 3]])
            margin = half * 1.1 + 0.02
            images.append(E.render(*spec, rng.uniform(margin, 1 - margin), rng.uniform(margin, 1 - margin), half))
            prompts.append(E.caption(*spec))
    return prompts, images


def test_shapes_prompts_as_geneval_metadata():
    m = shapes_metadata("a small red circle on a blue background")
    assert m.as_row()["include"] == [{"class": "circle", "count": 1, "color": "red"},
                                     {"class": "background", "count": 1, "color": "blue"}]
    with pytest.raises(ValueError, match="row 3: shape_verifier: cannot parse"):
        shapes_metadata("a photo of a cat", "row 3")


@pytest.mark.slow
def test_shapes_backend_strict_rate_is_the_verifiers_all_three_right():
    reward = get_reward("geneval", backend="shapes")
    prompts, images = _renders(n_layouts=2)
    clean = reward.fn.verify(prompts, images)["all"]
    assert torch.equal(clean, verify(prompts, images)["all"]) and float(clean.mean()) == 1.0
    # degraded, shuffled prompts and noise: the verdicts differ from 1 and still agree image by image
    gen = torch.Generator().manual_seed(0)
    x = E.to_tensor(images)
    faded = E.degrade(x, "faded", torch.rand(len(images), generator=gen) * 0.5 + 0.5, gen)
    mixed = prompts[1:] + prompts[:1]
    noise = torch.rand(8, 3, 32, 32, generator=gen)
    for ps, ims in ((prompts, faded), (mixed, x), (prompts[:8], noise)):
        got = reward.fn.verify(ps, ims)["all"]
        assert torch.equal(got, verify(ps, ims)["all"])
    assert 0.2 < float(reward.fn.verify(prompts, faded)["all"].mean()) < 0.9


def test_geneval_reward_call_and_metrics():
    prompts, images = _renders()
    prompts, images = prompts[:6], images[:6]
    images[1] = images[0]                                           # a wrong image for prompt 1
    scores = get_reward("geneval", backend="shapes").fn(prompts, images)
    assert scores[0] == 1.0 and scores[1] < 1.0
    assert scores.metrics["strict"] == scores.metrics["fidelity"] == 5 / 6
    out = CombinedReward([get_reward("geneval", backend="shapes")])(prompts, images)
    assert out.function_metrics["geneval/strict"] == 5 / 6
    # GenEval columns given: they win over the prompt text (here: asking for the wrong colour everywhere)
    rows = [shapes_metadata(p).as_row() for p in prompts]
    for r in rows:
        r["include"][0]["color"] = "white" if r["include"][0]["color"] != "white" else "black"
    cols = {k: [r.get(k) for r in rows] for k in ("tag", "include")}
    assert get_reward("geneval", backend="shapes", score="strict").fn(prompts, images, **cols) == [0.0] * 6


def test_geneval_reward_errors():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        GenEvalReward(backend="nope")
    with pytest.raises(ValueError, match="score must be"):
        GenEvalReward(backend="shapes", score="soft")
    backend = DetectorBackend(FakeDetector([[]]), ClipColourClassifier(clip=E.load_embedded_clip(), device="cpu"))
    reward = GenEvalReward(backend=backend)
    with pytest.raises(ValueError, match="geneval row 0: no GenEval metadata"):
        reward(["a photo of a cat"], torch.rand(1, 3, 32, 32))
    with pytest.raises(ValueError, match="geneval row 1: tag 'pose'"):
        reward(["a", "b"], torch.rand(2, 3, 32, 32), tag=["single_object", "pose"],
               include=[[{"class": "cat"}], [{"class": "cat"}]])
