"""The ``ocr`` reward (Flow-GRPO's text-rendering reward): the target rule, normalisation, edit distance and score
worked by hand, the errors, the confidence filter on a stand-in engine, and the real PP-OCRv4 backend
(``rapidocr_onnxruntime``, the ``ocr`` extra; skipped when it is not installed) on PIL-rendered text."""

from __future__ import annotations

import glob
import itertools
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from unialign.rewards import get_reward
from unialign.rewards.ocr import (
    OcrReward,
    edit_distance,
    normalise_text,
    ocr_score,
    ocr_target,
    ocr_targets,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ target
@pytest.mark.parametrize("prompt, target", [
    ('A sign that says "OPEN 24 HOURS"', "OPEN 24 HOURS"),
    ("A sign that says “OPEN 24 HOURS”", "OPEN 24 HOURS"),             # curly double quotes
    ('A mug with “COFFEE" on it', "COFFEE"),                           # mixed pair
    ('"HELLO" and "WORLD" on two lines', "HELLO WORLD"),               # several spans: joined with a space
    ('A sign "  OPEN  " with padding', "OPEN"),                        # spans are stripped
    ("A cat's sign that says 'OPEN'", "OPEN"),                         # apostrophe is not a quote
    ("A banner reading 'DON'T STOP'", "DON'T STOP"),                   # apostrophe inside single quotes
    ("A label ‘SALE’ on a box", "SALE"),                               # curly single quotes
    ('A sign \'ignored\' that says "USED"', "USED"),                   # single quotes only without double
    ('An empty "" then "TEXT"', "TEXT"),                               # empty span dropped
])
def test_ocr_target_reads_the_quoted_spans(prompt, target):
    assert ocr_target(prompt) == target


@pytest.mark.parametrize("prompt", ["A sign in a street", 'A sign that says "OPEN', 'Quotes "" with nothing',
                                    "the dogs' bowl", ""])
def test_ocr_target_is_none_without_a_closed_non_empty_span(prompt):
    assert ocr_target(prompt) is None


def test_ocr_targets_names_the_row_and_the_prompt_of_a_missing_target():
    assert ocr_targets(['a "A"', "b 'B'"]) == ["A", "B"]
    with pytest.raises(ValueError, match=r"^ocr: prompt 1 has no quoted target text .*: 'a plain street'$"):
        ocr_targets(['a sign "OPEN"', "a plain street"])
    with pytest.raises(ValueError, match="prompt 0 has no quoted target"):
        ocr_targets(['a sign " \t "'])  # whitespace only in quotes: no target


# --------------------------------------------------------------------------- normalisation, distance
def test_normalise_text_removes_all_whitespace_and_lower_cases():
    assert normalise_text("Hello World") == "helloworld"
    assert normalise_text(" O P\tE\nN\u00a024 ") == "open24"  # tab, newline, no-break space
    assert normalise_text("") == ""


@pytest.mark.parametrize("a, b, d", [
    ("kitten", "sitting", 3),  # k->s, e->i, +g
    ("flaw", "lawn", 2),       # -f, +n
    ("", "abc", 3), ("abc", "", 3), ("", "", 0),
    ("hello", "hello", 0), ("hello", "helo", 1), ("open", "closed", 4),  # +c +l, o, p->s, e, n->d
    ("ab", "ba", 2),           # no transpositions: two substitutions
])
def test_edit_distance_by_hand(a, b, d):
    assert edit_distance(a, b) == d
    assert edit_distance(b, a) == d


def _distance_by_recursion(a: str, b: str) -> int:
    if not a or not b:
        return len(a) + len(b)
    return min(_distance_by_recursion(a[1:], b) + 1, _distance_by_recursion(a, b[1:]) + 1,
               _distance_by_recursion(a[1:], b[1:]) + (a[0] != b[0]))


def test_edit_distance_matches_the_recursive_definition_on_all_short_strings():
    words = ["".join(w) for n in range(4) for w in itertools.product("ab", repeat=n)] + ["abc", "cab", "bca"]
    for a, b in itertools.product(words, repeat=2):
        assert edit_distance(a, b) == _distance_by_recursion(a, b), (a, b)


# ---------------------------------------------------------------------------------------- score
@pytest.mark.parametrize("recognised, target, score", [
    ("helo", "hello", 0.8),                        # d = 1, L = 5: 1 - 1/5
    ("hellp", "hello", 0.8),                       # one substitution
    ("xxHELLOyy", "hello", 1.0),                   # contained (case-insensitive)
    ("", "hello", 0.0),                            # nothing read: d = L
    ("zzzzzzzzzzzzzzzzzzzz", "hello", 0.0),        # d = 20, capped at L = 5
    ("H E L L O", "hello", 1.0),                   # spaces removed
    ("Helo World", "HELLO WORLD", 0.9),            # L = 10 ("helloworld"), d = 1
    ("open24hour", "OPEN 24 HOURS", 10 / 11),      # L = 11, d = 1
    ("closed", "open", 0.0),                       # d = 4 = L
    ("opn", "open", 0.75),                         # d = 1, L = 4
])
def test_ocr_score_by_hand(recognised, target, score):
    assert ocr_score(recognised, target) == score


def test_ocr_score_refuses_an_empty_target():
    with pytest.raises(ValueError, match="empty once whitespace is removed"):
        ocr_score("anything", " \n ")


# ------------------------------------------------------------------------ errors, stand-in engine
def test_missing_extra_is_one_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # "import rapidocr_onnxruntime" now fails
    with pytest.raises(ImportError, match=r'needs the OCR extra.*pip install -e "\.\[ocr\]"'):
        OcrReward()
    with pytest.raises(ImportError, match="OCR extra"):
        get_reward("ocr")


@pytest.mark.parametrize("kwargs, message", [({"min_confidence": 1.5}, "min_confidence"),
                                             ({"num_threads": 0}, "num_threads"),
                                             ({"num_threads": 2.0}, "num_threads")])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OcrReward(**kwargs)


class FixedEngine:
    """Stands in for ``RapidOCR``: returns the same boxes for every image and records the calls."""

    def __init__(self, boxes):
        self.boxes, self.calls = boxes, []

    def __call__(self, image, use_cls=None):
        self.calls.append((image, use_cls))
        return (self.boxes, [0.0]) if self.boxes else (None, None)


BOX = [[0, 0], [10, 0], [10, 5], [0, 5]]


def test_boxes_below_min_confidence_or_at_zero_are_dropped_and_the_rest_joined_in_order():
    engine = FixedEngine([[BOX, "OPEN", 0.9], [BOX, "XX", 0.3], [BOX, "24", 0.5], [BOX, "YY", 0.0]])
    reward = OcrReward(engine=engine)  # min_confidence 0.5 by default
    image = Image.new("RGB", (32, 32), "white")
    assert reward.read(image) == [("OPEN", 0.9), ("24", 0.5)]
    assert reward.recognise(image) == "OPEN24"
    assert OcrReward(min_confidence=0.0, engine=engine).recognise(image) == "OPENXX24"  # 0.0 still dropped
    scores = reward(prompts=['a sign "open 24"', 'a sign "OPEN 25"'], completions=[image, image])
    assert scores == [1.0, 5 / 6]  # "open24" read: contained; "open25": L = 6, d = 1
    assert engine.calls[0][1] is False  # no angle classifier by default
    assert isinstance(engine.calls[0][0], Image.Image) and engine.calls[0][0].mode == "RGB"


def test_stand_in_engine_every_input_form_and_no_text():
    reward = OcrReward(engine=FixedEngine([]))
    batch = torch.zeros(2, 3, 16, 16)  # float BCHW in [0, 1]
    assert reward(prompts=['"A"', '"B"'], completions=batch) == [0.0, 0.0]
    hwc = np.zeros((16, 16, 3), dtype=np.uint8)
    assert reward(prompts=['"A"'], completions=[hwc]) == [0.0]
    with pytest.raises(ValueError, match="2 prompts for 1 images"):
        reward(prompts=['"A"', '"B"'], completions=[hwc])
    with pytest.raises(ValueError, match="prompt 1 has no quoted target"):
        reward(prompts=['"A"', "no quotes"], completions=[hwc, hwc])
    with pytest.raises(TypeError, match="needs the prompts"):
        reward(completions=[hwc])
    assert reward.name == "ocr"


# ------------------------------------------------------------------------------ the real backend
def _font_path() -> str:
    for pattern in ("/usr/share/fonts/**/DejaVuSans-Bold.ttf", "/usr/share/fonts/**/DejaVuSans.ttf",
                    "/usr/share/fonts/**/*.ttf", "/usr/local/share/fonts/**/*.ttf"):
        found = sorted(glob.glob(pattern, recursive=True))
        if found:
            return found[0]
    pytest.skip("no TrueType font on this machine (e.g. apt-get install fonts-dejavu-core)")


def _word_image(word: str, size: int = 72) -> Image.Image:
    """``word`` in black at ``size`` px on a white 512x512 image, centred."""
    font = ImageFont.truetype(_font_path(), size)
    image = Image.new("RGB", (512, 512), (250, 250, 245))
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    draw.text(((512 - (right - left)) // 2 - left, (512 - (bottom - top)) // 2 - top), word, font=font,
              fill=(15, 15, 15))
    return image


@pytest.fixture(scope="module")
def real_reward():
    pytest.importorskip("rapidocr_onnxruntime", reason="the ocr extra is not installed: pip install -e '.[ocr]'")
    return OcrReward(num_threads=1)


def test_real_ocr_reads_a_clean_word(real_reward):
    image = _word_image("OPEN")
    assert "open" in normalise_text(real_reward.recognise(image))
    assert real_reward(prompts=['A shop sign that says "OPEN"'], completions=[image])[0] >= 0.8


def test_real_ocr_blank_image_reads_nothing_and_scores_zero(real_reward):
    blank = Image.new("RGB", (512, 512), (250, 250, 245))
    assert real_reward.read(blank) == []
    assert real_reward(prompts=['A sign that says "OPEN"'], completions=[blank]) == [0.0]


def test_real_ocr_wrong_word_scores_low(real_reward):
    assert real_reward(prompts=['A sign that says "OPEN"'], completions=[_word_image("CLOSED")])[0] < 0.5


def test_real_ocr_batch_through_the_registry():
    pytest.importorskip("rapidocr_onnxruntime", reason="the ocr extra is not installed: pip install -e '.[ocr]'")
    reward = get_reward("ocr", num_threads=1)
    assert reward.name == "ocr"
    images = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255.0
                          for im in (_word_image("HELLO WORLD", 56), Image.new("RGB", (512, 512), "white"))])
    scores = reward.score(['A poster with the text "Hello World"', 'A sign that says "HELLO"'], images)
    assert scores.dtype == torch.float64 and scores.shape == (2,)  # the trainer's path: float64 [B]
    assert scores[0] >= 0.8 and scores[1] == 0.0


def test_a_script_without_the_extra_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    """The OCR reward chosen without its extra: one line naming the install, exit 2, before any model loads."""
    from tests.test_scripts import load_script
    from unialign.config import exit_on_user_error, parse_config
    from unialign.recipes.presets import OCR_PROMPTS

    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)
    module = load_script("grpo_image")
    with pytest.raises(SystemExit) as info, exit_on_user_error():
        module.main(parse_config(module.GRPOImageConfig, ["--reward_funcs", "ocr", "--prompt_set", OCR_PROMPTS,
                                                          "--output_dir", str(tmp_path / "out")]))
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1 and 'pip install -e ".[ocr]"' in err, err
