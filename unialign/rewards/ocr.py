"""OCR reward for text rendering (Flow-GRPO, Liu et al. 2025, arXiv 2505.05470; github yifan123/flow_grpo,
``flow_grpo/ocr.py``): how well an image shows the text the prompt asks for.

Rule, per image i with prompt i:
  * target = the text inside quotes in the prompt (``ocr_target``): ``A sign that says "OPEN 24 HOURS"``
    -> ``OPEN 24 HOURS``;
  * recognised = every text box the OCR reads in the image (reading order: top to bottom, left to right),
    boxes whose recognition confidence is below ``min_confidence`` (or not above 0) dropped, concatenated;
  * both strings normalised (``normalise_text``: all whitespace removed, lower-cased); L = len(target);
  * reward = 1 if the target is a substring of the recognised text, else ``1 - min(d, L) / L`` with
    d = Levenshtein distance (``ocr_score``). An image without recognised text scores 0; so does one with
    much unrelated text (the ``min`` caps the penalty at L).

Backend: PP-OCRv4 (det + rec ONNX models; the cls model too when ``use_angle_cls``) through the optional
``rapidocr_onnxruntime`` package, which ships the model files in its wheel (nothing is downloaded):
``pip install -e ".[ocr]"``. Flow-GRPO runs PaddleOCR 2.9 (``lang="en"``); the differences that matter:
rapidocr's models are the Chinese+English PP-OCRv4 ones (the recogniser can emit CJK characters / full-width
punctuation); its detector's thresholds are rapidocr's (box 0.5, unclip 1.6, dilation; PaddleOCR: 0.6, 1.5, none).
The detector's input resize is PaddleOCR's limit type (``DET_RESIZE``: "max", never upsample, so a 512 px image
is detected at 512; rapidocr 1.4 then shrinks only a long side > 2000 px, PaddleOCR one > 960 px), not rapidocr's
own "min" (upsample the short side to >= 736 px): on the rendered 512 px images of ``benchmarks/ocr_reward.py``
that is 2-3.5x faster at the same rewards. ``engine_kwargs`` passes rapidocr's options
through (``{"det_limit_side_len": 736, "det_limit_type": "min"}`` restores its resize). Flow-GRPO scores an image
whose OCR call raises as 0; here the exception propagates (``RewardFunction``'s ``on_error`` decides).
"""

from __future__ import annotations

import re
from typing import Any

OCR_EXTRA_MISSING = ('ocr reward needs the OCR extra, which is not installed: pip install -e ".[ocr]" '
                     "(or pip install 'rapidocr_onnxruntime>=1.4,<1.5')")

# The detector's input resize of PaddleOCR 2.x (tools/infer/utility.py: --det_limit_side_len 960,
# --det_limit_type max), which Flow-GRPO's PaddleOCR(lang="en") ran with; rapidocr's config.yaml has 736 / "min".
# (rapidocr 1.4's "max" mode picks its own limit, 960 / 1500 / 2000 by image size: the same for sides <= 960 px.)
DET_RESIZE = {"det_limit_side_len": 960, "det_limit_type": "max"}

# Quote characters: straight and curly double quotes pair with each other in the order they appear, so
# ``"OPEN"``, ``“OPEN”`` and a mixed ``“OPEN"`` all give OPEN. Single quotes (straight, curly) are used only
# when the prompt has no double-quoted span, and only as quotes, not apostrophes: the opening one must not
# follow a letter/digit (``cat's``) and the closing one must not precede one (``'DON'T STOP'`` -> DON'T STOP).
_DOUBLE_QUOTED = re.compile(r'["“”]([^"“”]*)["“”]')
_SINGLE_QUOTED = re.compile(r"(?<!\w)['‘’](.+?)['‘’](?!\w)")


# ---------------------------------------------------------------------------------------------
# Pure functions: target, normalisation, edit distance, score
# ---------------------------------------------------------------------------------------------
def ocr_target(prompt: str) -> str | None:
    """The text the prompt asks the image to show: its quoted spans, or None when it has none.

    Rule: the double-quoted spans (straight ``"`` and curly ``“ ”``, paired in order of appearance); if there
    are none, the single-quoted spans (``' '`` / ``‘ ’``, apostrophes inside words ignored). Each span is
    stripped; empty spans are dropped; several spans are joined with one space (the image must show all of
    them; the OCR reads all text boxes, so the scorer compares against all of them). Flow-GRPO takes
    ``prompt.split('"')[1]``, i.e. the first straight-quoted span only; on its text-rendering prompts (one
    quoted span each) both rules give the same target. A quote left unclosed is not a span.

    Args:
        prompt: the prompt text (str).
    Returns:
        the target text (str, not normalised) or None.
    """
    spans = [s.strip() for s in _DOUBLE_QUOTED.findall(prompt)]
    if not any(spans):
        spans = [s.strip() for s in _SINGLE_QUOTED.findall(prompt)]
    spans = [s for s in spans if s]
    return " ".join(spans) if spans else None


def normalise_text(s: str) -> str:
    """``s`` with every whitespace character removed (``str.split``'s: spaces, tabs, newlines, Unicode spaces)
    and lower-cased (str -> str). Flow-GRPO removes ``" "`` only; the two agree on its prompts."""
    return "".join(s.split()).lower()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance between two strings (int >= 0): the fewest single-character insertions, deletions
    and substitutions (unit cost each) turning ``a`` into ``b``; characters are Unicode code points.

    A plain two-row dynamic programme, O(len(a) * len(b)) time, O(min(len)) memory: neither ``Levenshtein``
    (what Flow-GRPO imports) nor ``rapidfuzz`` is a dependency of this package, and OCR strings are short.
    """
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))  # distances from a[:0] to every prefix of b
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1,                 # delete ca
                               current[j - 1] + 1,              # insert cb
                               previous[j - 1] + (ca != cb)))   # substitute (free when equal)
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str) -> float:
    """Flow-GRPO's OCR reward of one image, a float in [0, 1].

    Both strings are normalised (``normalise_text``); L = len(normalised target). Returns 1.0 when the target
    is a substring of the recognised text, else ``1 - min(edit_distance(recognised, target), L) / L``
    (computed as ``(L - min(d, L)) / L``, so e.g. 4/5 is exactly 0.8). Empty recognised text gives 0.

    Args:
        recognised: the text read in the image (str; may be empty).
        target: the text the prompt asks for (str).
    Raises:
        ValueError: the target is empty after normalisation (the score would divide by 0).
    """
    rec, tgt = normalise_text(recognised), normalise_text(target)
    if not tgt:
        raise ValueError(f"ocr_score: the target {target!r} is empty once whitespace is removed")
    if tgt in rec:
        return 1.0
    d = min(edit_distance(rec, tgt), len(tgt))
    return (len(tgt) - d) / len(tgt)


def ocr_targets(prompts: list[str]) -> list[str]:
    """``ocr_target`` of every prompt (list[str] -> list[str], same length), all checked first.

    Raises:
        ValueError: a prompt has no quoted target, or only whitespace in quotes; the message names its row
            index and the prompt, on one line.
    """
    targets = []
    for i, prompt in enumerate(prompts):
        target = ocr_target(prompt)
        if target is None or not normalise_text(target):
            raise ValueError(f"ocr: prompt {i} has no quoted target text (put it in quotes, e.g. "
                             f'a sign that says "OPEN"): {prompt!r}')
        targets.append(target)
    return targets


# ---------------------------------------------------------------------------------------------
# The reward
# ---------------------------------------------------------------------------------------------
class OcrReward:
    """Flow-GRPO's text-rendering reward (module docstring) with TRL's reward signature, on the PP-OCRv4 ONNX
    models of ``rapidocr_onnxruntime`` (the ``ocr`` extra), on CPU.

    ``reward(prompts=[str, ...], completions=images) -> list[float]`` in [0, 1], one per image. ``completions``
    are PIL images, uint8 HWC numpy arrays, or float tensors / arrays in [0, 1], [3,H,W] each or one [B,3,H,W]
    batch (``unialign.rewards.image.to_pil_images``, rounded to 8 bits). Prompts are strings (or chat messages:
    their text content); every prompt needs a quoted target (``ocr_target``), else ValueError naming the row.

    Args:
        use_angle_cls: run PP-OCR's text-direction classifier (0 vs 180 degrees) on each detected box. Off by
            default, as in Flow-GRPO (``use_angle_cls=False``, ``cls=False``): generated text is upright, and
            the classifier costs time and can flip a correct upright reading.
        min_confidence: recognised boxes with a confidence below it are dropped (boxes at confidence 0 always
            are, as in Flow-GRPO). Default 0.5: PaddleOCR's ``drop_score`` default, which Flow-GRPO's
            ``PaddleOCR(...)`` ran with (its own ``> 0`` test then drops nothing more); rapidocr's
            ``text_score`` default is 0.5 too.
        num_threads: onnxruntime intra-op threads per model session (default 1: rewards run beside the policy,
            and a 512 px image takes ~0.15 s on one core; values above the machine's core count mean "all").
        engine_kwargs: extra keyword arguments for ``rapidocr_onnxruntime.RapidOCR`` (its config keys, e.g.
            ``det_limit_side_len``, ``det_box_thresh``, ``rec_batch_num``); they override ``DET_RESIZE``.
        engine: a ready OCR engine called like ``RapidOCR``: ``engine(pil_image, use_cls=bool) ->
            (None or [[box, text, confidence], ...], timings)``; skips the import and the options above but
            ``use_angle_cls`` / ``min_confidence`` (a shared engine, or a stand-in in tests).
    Raises:
        ImportError: no ``engine`` given and ``rapidocr_onnxruntime`` is not installed (the message names the
            extra).
    """

    name = "ocr"

    def __init__(self, use_angle_cls: bool = False, min_confidence: float = 0.5, num_threads: int = 1,
                 engine_kwargs: dict[str, Any] | None = None, engine: Any = None) -> None:
        if not 0.0 <= float(min_confidence) <= 1.0:
            raise ValueError(f"ocr: min_confidence must be in [0, 1], got {min_confidence!r}")
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"ocr: num_threads must be an int >= 1, got {num_threads!r}")
        self.use_angle_cls = bool(use_angle_cls)
        self.min_confidence = float(min_confidence)
        self.num_threads = num_threads
        if engine is not None:
            self.engine = engine
            return
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as err:  # missing, or a dependency of it (onnxruntime, cv2) missing / broken
            from unialign.errors import MissingExtraError

            raise MissingExtraError(f"{OCR_EXTRA_MISSING} [{type(err).__name__}: {err}]") from None
        options = {"use_cls": self.use_angle_cls, "print_verbose": False,
                   "text_score": 0.0,  # the engine keeps every box; ``read`` applies min_confidence
                   "intra_op_num_threads": num_threads, "inter_op_num_threads": 1, **DET_RESIZE}
        options.update(engine_kwargs or {})
        self.engine = RapidOCR(**options)

    def read(self, image: Any) -> list[tuple[str, float]]:
        """The text boxes the OCR reads in one image: [(text, confidence)] in reading order (top to bottom,
        left to right), boxes below ``min_confidence`` or at confidence <= 0 dropped. ``image``: anything
        ``to_pil_images`` takes for one image (PIL, [H,W,3] uint8, [3,H,W] float in [0, 1])."""
        from unialign.rewards.image import to_pil_images

        (pil,) = to_pil_images([image])
        # a PIL image: rapidocr converts it RGB -> BGR itself (a raw array would be taken as BGR already)
        result, _ = self.engine(pil, use_cls=self.use_angle_cls)
        boxes = []
        for _box, text, confidence in result or []:
            if float(confidence) > 0.0 and float(confidence) >= self.min_confidence:
                boxes.append((str(text), float(confidence)))
        return boxes

    def recognise(self, image: Any) -> str:
        """All text read in one image, the kept boxes concatenated in reading order (str; "" when none)."""
        return "".join(text for text, _ in self.read(image))

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        """B rewards in [0, 1] (list[float]) for B prompts and B images (class docstring)."""
        from unialign.rewards.base import completion_to_text
        from unialign.rewards.image import to_pil_images

        if prompts is None:
            raise TypeError("ocr needs the prompts (the target text is quoted in each)")
        texts = [p if isinstance(p, str) else completion_to_text(p) for p in prompts]
        targets = ocr_targets(texts)  # every prompt checked before any OCR runs
        images = to_pil_images(completions)
        if len(images) != len(targets):
            raise ValueError(f"ocr: {len(targets)} prompts for {len(images)} images")
        return [ocr_score(self.recognise(im), target) for im, target in zip(images, targets)]
