"""The offline embedded default for video inputs: questions about the motion world's clips, asked of a tiny
Qwen2-VL-architecture model that half-knows the answers.

The task
--------
Videos are the motion world's clips (``motion_world.render_clip``: 5 frames of 32x32, a circle, bar or column of
one of 8 colours moving left / right / up / down on a background of another colour), given as a list of PIL frames in the
``video`` column, asked in TRL's VLM format with a ``{"type": "video"}`` block. Four one-word questions
(``QUESTIONS``): the image task's three (``vlm.QUESTIONS``: the shape's colour, the shape, the background) and::

    "Which way does the shape move?"   -> "left"     (question_type "direction")

* The split is the motion world's own (``motion_world.prompts("test")``, 77 of 672 prompts held out of every
  build): every held-out clip shows an unseen (shape, colour, background, direction) combination.
  ``CLIPS_PER_PROMPT`` clips of each prompt, drawn from a ``random.Random`` seeded by (prompt, index): the same
  clips whatever the seed or the question.
* Answers are checked as the image task's (``vlm.is_correct`` / ``vlm_accuracy``: the bare word or
  ``Answer: word``).

The model and why it suits RL
-----------------------------
``assets/vlm_video``: the embedded image VLM (``vlm.py``) extended, by ``tools/build_vlm_video.py`` (numbers in
``BUILD.md`` there): its tokenizer with the direction and shape words added (``VIDEO_WORDS``, single tokens), its
weights copied token by token, then its vision tower taught to read motion (a classifier stage on clips) and its language
model the four questions on clips. As for the image VLM, the build trains with a systematic confusion
(``CONFUSIONS``: the image task's red <-> orange and blue <-> purple, circle <-> bar, and left <-> right) at a rate
above 1/2, so greedy decoding says "right" for a shape moving left while the true answer keeps a usable
probability: room a verifiable reward can fill. The dataset's solutions (and so the reward) are always true.

``accelerate launch scripts/grpo_vision.py --dataset_name embedded-vlm-video`` trains it (the data set names its
model: ``DATASET_MODEL``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from unialign.embedded import motion_world, vlm

NAME = "embedded-vlm-video"  # the data set, the pair data set and the model
VLM_VIDEO_DIR = Path(__file__).resolve().parent / "assets" / "vlm_video"
DIRECTION_QUESTION = "Which way does the shape move?"
QUESTIONS = {**vlm.QUESTIONS, "direction": DIRECTION_QUESTION}
QA_TYPES = tuple(QUESTIONS)
DIRECTIONS = tuple(motion_world.DIRECTIONS)  # left, right, up, down
# The words the video model adds to the image model's (``vlm.WORDS``), each one token. Append only.
SHAPES = motion_world.SHAPES  # circle, bar, column (the image task's: circle, square, triangle)
VIDEO_WORDS = ("Which", "which", "way", "move", "moves", "moving", "video", "clip") + DIRECTIONS + ("bar", "column")
CONFUSIONS: dict[str, str] = {**{k: v for k, v in vlm.CONFUSIONS.items() if k in vlm.COLOURS},
                              "circle": "bar", "bar": "circle", "left": "right", "right": "left"}
CLIPS_PER_PROMPT = 2


def build_tokenizer():
    """The image VLM's tokenizer (``vlm.build_tokenizer``) with ``VIDEO_WORDS`` added as single tokens."""
    return vlm.build_tokenizer(vlm.WORDS + VIDEO_WORDS)


def parts_of(prompt: str) -> dict[str, str]:
    """{question type: answer} of a motion-world prompt ("a red circle moving left on a blue background")."""
    shape, colour, background, direction = motion_world.parse_motion_prompt(prompt)
    return {"colour": colour, "shape": shape, "background": background, "direction": direction}


def clip_of(prompt: str, index: int) -> list:
    """Clip ``index`` of ``prompt`` (5 PIL frames): the same frames on every machine, whatever the seed."""
    shape, colour, background, direction = motion_world.parse_motion_prompt(prompt)
    return motion_world.render_clip(shape, colour, background, direction, random.Random(f"vlm-video:{prompt}:{index}"))


def video_dataset(split: str, n: int | None = None, seed: int = 0,
                  question_types: tuple[str, ...] | list[str] = QA_TYPES) -> list[dict[str, Any]]:
    """Deterministic rows of the video task in TRL's format: ``{"prompt": [user turn: video block, question],
    "video": [5 PIL frames], "solution", "question_type", "caption"}`` (``caption``: the clip's prompt).

    split: ``"train"`` (595 prompts) or ``"test"`` (77; ``motion_world.prompts``): disjoint by prompt.
    n: the first ``n`` rows of the shuffled split (``None``: all; ``CLIPS_PER_PROMPT`` clips per prompt, one row per
       clip and question type: 4760 train / 616 test rows).
    seed: shuffles the order; the clips and answers do not depend on it.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    unknown = [t for t in question_types if t not in QA_TYPES]
    if unknown or not question_types:
        raise ValueError(f"question_types must be a non-empty subset of {QA_TYPES}, got {question_types!r}")
    rows = []
    for prompt in motion_world.prompts(split):
        answers = parts_of(prompt)
        for k in range(CLIPS_PER_PROMPT):
            frames = clip_of(prompt, k)
            for qt in question_types:
                rows.append({"prompt": vlm.user_message(QUESTIONS[qt], "video"), "video": frames,
                             "solution": answers[qt], "question_type": qt, "caption": prompt})
    random.Random(f"vlm-video-{split}-{seed}").shuffle(rows)
    return rows[:n] if n is not None else rows


def wrong_answer(row: dict[str, Any], rng: random.Random, confusion_share: float = 0.5) -> str:
    """A wrong answer for ``row``: its ``CONFUSIONS`` partner with probability ``confusion_share`` when it has one
    (the shipped model's typical mistake), else another word of the same kind, never the clip's other colour."""
    solution, qt = row["solution"], row["question_type"]
    if solution in CONFUSIONS and rng.random() < confusion_share:
        return CONFUSIONS[solution]
    parts = parts_of(row["caption"])
    pool = {"direction": DIRECTIONS, "shape": SHAPES}.get(qt, vlm.COLOURS)
    if qt in ("colour", "background"):
        pool = tuple(c for c in pool if c not in (parts["colour"], parts["background"]))
    return rng.choice([w for w in pool if w != solution])


def preference_pairs(split: str, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Preference pairs on the video task (TRL's conversational format with a ``video`` column): the true answer
    ``chosen``, ``wrong_answer`` ``rejected``, each one assistant message. Deterministic."""
    rng = random.Random(f"vlm-video-pairs-{split}-{seed}")
    return [{"prompt": r["prompt"], "video": r["video"], "chosen": [{"role": "assistant", "content": r["solution"]}],
             "rejected": [{"role": "assistant", "content": wrong_answer(r, rng)}],
             "question_type": r["question_type"], "caption": r["caption"]}
            for r in video_dataset(split, n=n, seed=seed)]


def load_embedded_vlm_video(path: str | Path | None = None):
    """``(model, processor)`` of the shipped video VLM (``vlm.load_embedded_vlm`` on ``VLM_VIDEO_DIR``)."""
    return vlm.load_embedded_vlm(VLM_VIDEO_DIR if path is None else path)
