"""The offline "embedded default" for vision-language RL: questions about the shapes world's images, a tiny
Qwen2-VL-architecture model that half-knows the answers, its verifiable reward and its use as an image judge.

Why this exists
---------------
A VLM GRPO / DPO demo must run offline on two CPU cores in minutes and show a held-out gain. Real VLMs cannot be
downloaded here and are far too slow on CPU, so, as for the arithmetic task (``arith``) and the shapes world
(``shapes_world``), the package ships its own task, processor and model, built in code by
``tools/build_vlm.py`` (source checkout, not installed) into ``unialign/embedded/assets/vlm`` (numbers in
``BUILD.md`` there). The folder is a stock transformers checkpoint: ``AutoModelForImageTextToText`` /
``AutoProcessor.from_pretrained(VLM_DIR)`` load it (``load_embedded_vlm``).

The task
--------
Images are the shapes world's 32x32 renders (``shapes_world.render``: one circle / square / triangle of one of 8
colours on a background of another), in random sizes and positions. Three one-word questions (``QUESTIONS``)::

    "What colour is the shape?"        -> "red"      (question_type "colour")
    "What shape is it?"                -> "circle"   (question_type "shape")
    "What colour is the background?"   -> "blue"     (question_type "background")

and the judge question (``judge_question``, question_type ``"judge"``) -> ``"yes"`` / ``"no"``::

    "Does this image show: a red circle on a blue background?"

Negatives of the judge are captions that differ from the image's in one attribute (colour, shape or background).

* Rows are in TRL's vision-language format: ``{"prompt": [{"role": "user", "content": [{"type": "image"},
  {"type": "text", "text": question}]}], "image": <PIL.Image>, "solution": "red", "question_type": "colour",
  "caption": "a red circle on a blue background"}`` (``vlm_dataset``); preference pairs add ``chosen`` /
  ``rejected`` as assistant messages (``preference_pairs``, RLAIF-V's layout with one image column).
* The split is the shapes world's own (``shapes_world.prompts("test")``, 18 of 168 captions): every held-out
  image shows an unseen (shape, colour, background) combination, though each colour and shape is seen in training.
* **Answer form** (``is_correct``): the completion is the answer word itself (``"red"``; what the model is
  trained to say), or contains ``Answer: red`` (the last ``Answer:`` counts). Case, surrounding whitespace and a
  final period are ignored, ``color`` / ``colour`` alike; anything else (two words, ``"red or blue"``) is wrong.
  ``accuracy_reward`` is that check with TRL's reward signature.
* The judge's reward is P(yes) / (P(yes) + P(no)) of the next token after the chat template's assistant prefix
  (``judge_prompt`` / ``judge_token_ids`` / ``judge_scores``); ``"yes"`` and ``"no"`` are single tokens.

Why it suits RL (the deliberate imperfection of the warm start)
---------------------------------------------------------------
As for the arithmetic model, the build trains with **label noise**: a *systematic confusion*
(``CONFUSIONS``: red <-> orange, blue <-> purple, circle <-> square). Each time a training question whose true
answer is one of those words is used, with probability ``confusion_rate`` (above 1/2, ``BUILD.md``) its SFT target
is the partner word instead. The model therefore reads the images (greedy accuracy 0.82 on the other words) but
answers the confused words wrongly under greedy decoding (0.24), while the right answer keeps a usable
probability (pass@8 at temperature 1: 0.87). The dataset's solutions (and so the verifiable reward) are always true;
the noise exists only inside the build. GRPO on the training split then flips the confused answers, which
carries to the held-out images (the same colours and shapes in unseen combinations).

The tokenizer, processor and model
----------------------------------
* tokenizer: byte-level BPE (``tokenizers``) with no merges and ``ignore_merges``: the 256 byte symbols (any text
  tokenizes) plus every task word (``WORDS``, with and without a leading space) as one token, and the specials
  ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), ``<|vision_start|>``, ``<|vision_end|>``,
  ``<|image_pad|>``, ``<|video_pad|>``; ChatML chat template (``CHAT_TEMPLATE``) rendering typed content blocks.
* processor: ``Qwen2VLProcessor`` with ``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor`` at patch 4, merge 2,
  temporal patch 2 and exactly 32x32 pixels: an image is a 1x8x8 patch grid, 16 image tokens, pixel rows of 96.
* model: ``Qwen2VLForConditionalGeneration`` in miniature (``build_model``; sizes in ``BUILD.md``).

Export to files (TRL's VLM format, images as PNG paths relative to the jsonl)::

    python -m unialign.embedded.vlm export --out DIR [--n-train N] [--n-test N] [--seed S] [--judge]

writes ``DIR/train.jsonl``, ``DIR/test.jsonl`` and ``DIR/images/{train,test}_00000.png`` ...

The builder (source checkout)::

    python -m tools.build_vlm build --out unialign/embedded/assets/vlm   # deterministic rebuild
    python -m tools.build_vlm eval [--path DIR]                          # held-out QA / pass@8 / judge numbers
    python -m tools.build_vlm check                                      # rebuild in a temp folder, compare files
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

VLM_DIR = Path(__file__).resolve().parent / "assets" / "vlm"
DEFAULT_ASSET_DIR = VLM_DIR
IMAGE_SIZE = 32  # = shapes_world.IMAGE_SIZE
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 4, 2, 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // MERGE_SIZE**2  # 16 per 32x32 image

# the shapes world's vocabulary (shapes_world.SHAPES / COLOURS; repeated so that importing this module stays light)
SHAPES = ("circle", "square", "triangle")
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black")

QUESTIONS = {
    "colour": "What colour is the shape?",
    "shape": "What shape is it?",
    "background": "What colour is the background?",
}
QA_TYPES = tuple(QUESTIONS)
QUESTION_TYPES = QA_TYPES + ("judge",)
JUDGE_TEMPLATE = "Does this image show: {caption}?"
YES, NO = "yes", "no"
IMAGES_PER_CAPTION = 8  # the data set: this many layouts of every caption of the split
MAX_NEW_TOKENS = 8  # an answer is one word token + <|im_end|>

# The systematic confusion of the build's label noise (module docstring); symmetric.
CONFUSIONS: dict[str, str] = {"red": "orange", "orange": "red", "blue": "purple", "purple": "blue",
                              "circle": "square", "square": "circle"}

PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# Whole words that are single tokens (with and without a leading space). Order matters (token ids): append only.
WORDS = (
    ("user", "assistant", "system", "What", "what", "colour", "color", "is", "the", "shape", "it", "of",
     "background", "Does", "does", "this", "image", "show", "shows", "a", "an", "on", "and", "yes", "no",
     "Yes", "No", "Answer", "answer", "Is", "there", "in", "picture")
    + SHAPES + COLOURS
    + ("small", "medium", "large", "blurry", "faded", "noisy", "dark")
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---------------------------------------------------------------------------------------------
# Task
# ---------------------------------------------------------------------------------------------
def judge_question(caption: str) -> str:
    """The judge's question for ``caption`` (``"Does this image show: a red circle on a blue background?"``),
    exactly the wording the model was trained on."""
    return JUDGE_TEMPLATE.format(caption=" ".join(str(caption).split()).rstrip("."))


def user_message(question: str, media: str = "image") -> list[dict[str, Any]]:
    """TRL's conversational VLM prompt: one user turn with the image (``media="video"``: the video), then the
    question."""
    return [{"role": "user", "content": [{"type": media}, {"type": "text", "text": question}]}]


def _caption_parts(caption: str) -> tuple[str, str, str]:
    """(shape, colour, background) of a plain caption "a red circle on a blue background"."""
    words = caption.split()
    return words[2], words[1], words[5]


def answer_for(question_type: str, shape: str, colour: str, background: str) -> str:
    return {"colour": colour, "shape": shape, "background": background}[question_type]


def split_captions(split: str) -> list[str]:
    """The shapes world's plain captions of ``split`` ("train" / "test" / "all"), in its fixed order."""
    from unialign.embedded import shapes_world

    return shapes_world.prompts(split)


def random_layout(rng: random.Random) -> tuple[float, float, float]:
    """(cx, cy, half) as ``shapes_world.shape_dataset`` draws them: a size class, then position in the margins."""
    from unialign.embedded import shapes_world

    size = rng.choice(list(shapes_world.SIZES))
    half = rng.uniform(*shapes_world.SIZES[size])
    margin = half * 1.1 + 0.02
    return rng.uniform(margin, 1 - margin), rng.uniform(margin, 1 - margin), half


def render_caption(caption: str, layout: tuple[float, float, float]):
    """The 32x32 PIL image of a plain caption at ``layout`` (``shapes_world.render``)."""
    from unialign.embedded import shapes_world

    shape, colour, background = _caption_parts(caption)
    return shapes_world.render(shape, colour, background, *layout)


def judge_negative(caption: str, rng: random.Random, allowed: set[str] | None = None) -> str:
    """A caption differing from ``caption`` in one attribute (colour, shape or background; never colour ==
    background), drawn with ``rng``; one of ``allowed`` when given (the build: training captions only)."""
    from unialign.embedded import shapes_world

    shape, colour, background = _caption_parts(caption)
    for _ in range(1000):
        part = rng.choice(("colour", "shape", "background"))
        if part == "shape":
            shape2, colour2, background2 = rng.choice([s for s in SHAPES if s != shape]), colour, background
        elif part == "colour":
            shape2, colour2, background2 = shape, rng.choice([c for c in COLOURS if c not in (colour, background)]), background
        else:
            shape2, colour2, background2 = shape, colour, rng.choice([c for c in COLOURS if c not in (colour, background)])
        negative = shapes_world.caption(shape2, colour2, background2)
        if colour2 != background2 and (allowed is None or negative in allowed):
            return negative
    raise ValueError(f"no caption among the allowed ones differs from {caption!r} in one attribute")


def _images(split: str) -> list[tuple[str, Any]]:
    """(caption, image) for ``IMAGES_PER_CAPTION`` layouts of every caption of ``split``; each layout from a
    ``random.Random`` seeded by (caption, index): the same images whatever the seed or the question."""
    out = []
    for cap in split_captions(split):
        for k in range(IMAGES_PER_CAPTION):
            out.append((cap, render_caption(cap, random_layout(random.Random(f"vlm:{cap}:{k}")))))
    return out


def vlm_dataset(split: str, n: int | None = None, seed: int = 0,
                question_types: tuple[str, ...] | list[str] = QA_TYPES) -> list[dict[str, Any]]:
    """Deterministic rows of the VLM task in TRL's format (module docstring).

    split: ``"train"`` (150 captions) or ``"test"`` (18, ``shapes_world.prompts("test")``): disjoint by caption.
    n: the first ``n`` rows of the shuffled split (``None``: all; ``IMAGES_PER_CAPTION`` images per caption, one
       row per image and question type: 3600 train / 432 test QA rows).
    seed: shuffles the order (and draws the judge's negatives); the images and answers do not depend on it.
    question_types: any of ``QUESTION_TYPES`` (default the three QA types; ``"judge"`` adds one yes/no row per
       image, positive or negative (one attribute changed) alternately by image).
    Each row: ``{"prompt", "image", "solution", "question_type", "caption"}`` (``caption``: what the image shows).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    unknown = [t for t in question_types if t not in QUESTION_TYPES]
    if unknown or not question_types:
        raise ValueError(f"question_types must be a non-empty subset of {QUESTION_TYPES}, got {question_types!r}")
    rng = random.Random(f"vlm-{split}-{seed}")
    rows = []
    for i, (cap, image) in enumerate(_images(split)):
        parts = _caption_parts(cap)
        for qt in question_types:
            if qt == "judge":
                positive = i % 2 == 0
                shown = cap if positive else judge_negative(cap, rng)
                question, solution = judge_question(shown), YES if positive else NO
            else:
                question, solution = QUESTIONS[qt], answer_for(qt, *parts)
            rows.append({"prompt": user_message(question), "image": image, "solution": solution,
                         "question_type": qt, "caption": cap})
    rng.shuffle(rows)
    return rows[:n] if n is not None else rows


def _wrong_answer(row: dict[str, Any], rng: random.Random, confusion_share: float = 0.5) -> str:
    """A wrong answer for ``row``: the ``CONFUSIONS`` partner (the shipped model's typical mistake) with
    probability ``confusion_share`` when the answer has one, else another word of the same kind."""
    solution, qt = row["solution"], row["question_type"]
    if qt == "judge":
        return NO if solution == YES else YES
    if solution in CONFUSIONS and rng.random() < confusion_share:
        return CONFUSIONS[solution]
    pool = SHAPES if qt == "shape" else COLOURS
    if qt == "background":  # the object's colour is never the background's
        pool = tuple(c for c in pool if c != _caption_parts(row["caption"])[1])
    return rng.choice([w for w in pool if w != solution])


def preference_pairs(split: str, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Preference pairs on the QA task (RLAIF-V's layout in TRL's conversational format): ``prompt`` (the user
    turn with the image), ``image``, ``chosen`` (the correct answer) and ``rejected`` (a wrong one,
    ``_wrong_answer``), both as one assistant message; plus ``question_type`` / ``caption``. Deterministic."""
    rng = random.Random(f"vlm-pairs-{split}-{seed}")
    out = []
    for row in vlm_dataset(split, n=n, seed=seed):
        out.append({"prompt": row["prompt"], "image": row["image"],
                    "chosen": [{"role": "assistant", "content": row["solution"]}],
                    "rejected": [{"role": "assistant", "content": _wrong_answer(row, rng)}],
                    "question_type": row["question_type"], "caption": row["caption"]})
    return out


_ANSWER_RE = re.compile(r"answer\s*:\s*([a-z]+)")


def parse_answer(completion: Any) -> str | None:
    """The answer word of a completion (``is_correct``'s rule), lower case, ``None`` when there is none: the word
    after the last ``Answer:`` if there is one, else the whole completion when it is one word (a final ``.``/``!``
    ignored). Strings or conversational completions (the last assistant message's text)."""
    text = _completion_text(completion).strip().lower()
    found = _ANSWER_RE.findall(text)
    if found:
        word = found[-1]
    else:
        word = text.rstrip(".!").strip()
        if not re.fullmatch(r"[a-z]+", word):
            return None
    return "colour" if word == "color" else word


def is_correct(completion: Any, solution: str) -> bool:
    """Whether ``completion`` answers ``solution`` (module docstring: the bare word or ``Answer: word``)."""
    got = parse_answer(completion)
    return got is not None and got == str(solution).strip().lower()


def accuracy_reward(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float]:
    """1.0 where a completion answers its ``solution`` (``is_correct``), else 0.0; TRL's reward signature
    (``prompts`` and the other columns arrive in ``kwargs`` and are ignored). ``completions``: strings or TRL's
    conversational lists ``[{"role": "assistant", "content": "..."}]``."""
    if len(solution) != len(completions):
        raise ValueError(f"{len(solution)} solutions for {len(completions)} completions")
    return [1.0 if is_correct(c, s) else 0.0 for c, s in zip(completions, solution)]


accuracy_reward.needs_one_of = ("solution",)  # the column a run must have (checked before any model loads)


def _completion_text(completion: Any) -> str:
    """A string as is; a message list: the text of the last assistant message (typed text parts joined)."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    messages = [m for m in completion if isinstance(m, dict)]
    if not messages:
        return ""
    chosen = [m for m in messages if m.get("role") == "assistant"] or messages
    content = chosen[-1].get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------
def export(out_dir: str | Path, n_train: int | None = None, n_test: int | None = None, seed: int = 0,
           question_types: tuple[str, ...] | list[str] = QA_TYPES) -> dict[str, Path]:
    """Write ``train.jsonl`` / ``test.jsonl`` (TRL's VLM format: ``prompt``, ``image`` as a PNG path relative to
    the jsonl, ``solution``, ``question_type``, ``caption``) and ``images/<split>_00000.png`` ... under
    ``out_dir``. Returns {split: jsonl path}."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("test", n_test)):
        path = out / f"{split}.jsonl"
        with path.open("w") as f:
            for i, row in enumerate(vlm_dataset(split, n=n, seed=seed, question_types=question_types)):
                rel = f"images/{split}_{i:05d}.png"
                row["image"].save(out / rel)
                f.write(json.dumps({**row, "image": rel}) + "\n")
        paths[split] = path
    return paths


# ---------------------------------------------------------------------------------------------
# Tokenizer, processor, model
# ---------------------------------------------------------------------------------------------
def build_tokenizer(words: tuple[str, ...] = WORDS):
    """The byte-level, word-token ``PreTrainedTokenizerFast`` with ChatML specials (module docstring); left
    padding (generation). ``words``: the single-token words (the video task's model adds its own to ``WORDS``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(symbol, len(vocab))
    for word in words:
        for form in (word, "\u0120" + word):  # "Ġ": byte-level's leading space
            vocab.setdefault(form, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left",
                                 model_max_length=256, clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_processor(tokenizer):
    """``Qwen2VLProcessor`` for 32x32 images: patch 4, merge 2, temporal patch 2, exactly 1024 pixels (a 1x8x8
    grid, ``IMAGE_TOKENS`` = 16 tokens; other sizes are resized to about 1024 pixels)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    size = {"shortest_edge": IMAGE_SIZE * IMAGE_SIZE, "longest_edge": IMAGE_SIZE * IMAGE_SIZE}
    common = dict(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, size=size)
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**common), tokenizer=tokenizer,
                            video_processor=Qwen2VLVideoProcessor(**common), chat_template=CHAT_TEMPLATE)


MODEL_DEFAULTS = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384, vision_dim=64, vision_heads=2,
                      vision_depth=2, vision_mlp_ratio=2)


def build_model(tokenizer, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 384, vision_dim: int = 64, vision_heads: int = 2, vision_depth: int = 2,
                vision_mlp_ratio: int = 2, seed: int = 0):
    """A freshly initialised tiny ``Qwen2VLForConditionalGeneration`` (fp32, tied embeddings, M-RoPE), its
    special token ids and bos / eos / pad inside the tokenizer's vocabulary."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = hidden // heads
    spatial = (head_dim // 2 - head_dim // 8) // 2  # M-RoPE (temporal, height, width) of head_dim / 2: Qwen's 1:1.5:1.5
    section = [head_dim // 2 - 2 * spatial, spatial, spatial]
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_scaling={"type": "mrope", "mrope_section": section, "rope_theta": 10000.0},
                         bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD]),
        vision_config=dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden, num_heads=vision_heads,
                           patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
                           temporal_patch_size=TEMPORAL_PATCH_SIZE, in_channels=3, mlp_ratio=vision_mlp_ratio),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END], bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD],
                                               do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    return model


def load_embedded_vlm(path: str | Path | None = None):
    """``(model, processor)`` of ``path`` (default: the shipped ``VLM_DIR``), offline, model in eval mode; with
    stock ``AutoModelForImageTextToText`` / ``AutoProcessor``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    p = Path(path) if path is not None else VLM_DIR
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"no embedded VLM at {p}; rebuild it from a source checkout with "
                                f"`python -m tools.build_vlm build --out {p}`")
    processor = AutoProcessor.from_pretrained(str(p), local_files_only=True)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(str(p), local_files_only=True)
    model.eval()
    return model, processor


# ---------------------------------------------------------------------------------------------
# Inference helpers (evaluation and the judge)
# ---------------------------------------------------------------------------------------------
def chat_prompt(processor, question: str, media: str = "image") -> str:
    """The templated prompt text (with the assistant prefix) of one image (or video) + ``question``."""
    return processor.apply_chat_template(user_message(question, media), add_generation_prompt=True, tokenize=False)


def encode(processor, questions: list[str], images: list[Any] | None = None, videos: list[Any] | None = None):
    """Processor inputs (left-padded tensors) for one image + question per row, or one video (a list of frames)
    + question per row when ``videos`` is given."""
    processor.tokenizer.padding_side = "left"
    media = "video" if videos is not None else "image"
    texts = [chat_prompt(processor, q, media) for q in questions]
    if videos is not None:
        return processor(text=texts, videos=[list(v) for v in videos], padding=True, return_tensors="pt")
    return processor(text=texts, images=list(images or ()), padding=True, return_tensors="pt")


def generate_answers(model, processor, rows: list[dict[str, Any]], greedy: bool = True, num_samples: int = 1,
                     temperature: float = 1.0, batch_size: int = 64, seed: int = 0,
                     max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[str]]:
    """``num_samples`` decoded completions per row (greedy: one), HF ``generate`` stopping at ``<|im_end|>``."""
    import torch

    was_training = model.training
    model.eval()
    tok = processor.tokenizer
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if greedy:
        kw.update(do_sample=False)
        num_samples = 1
    else:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, num_return_sequences=num_samples)
        torch.manual_seed(seed)
    out: list[list[str]] = []
    per = max(1, batch_size // num_samples)
    with torch.no_grad():
        for i in range(0, len(rows), per):
            chunk = rows[i:i + per]
            enc = _encode_rows(processor, chunk)
            gen = model.generate(**enc, **kw)
            texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            out += [texts[j * num_samples:(j + 1) * num_samples] for j in range(len(chunk))]
    model.train(was_training)
    return out


def _encode_rows(processor, rows: list[dict[str, Any]]):
    """``encode`` of rows that carry an ``image`` each, or a ``video`` (frames) each."""
    questions = [_question(r) for r in rows]
    if all(r.get("video") is not None for r in rows):
        return encode(processor, questions, videos=[r["video"] for r in rows])
    return encode(processor, questions, images=[r["image"] for r in rows])


def _question(row: dict[str, Any]) -> str:
    """The question text of a row's (last) user turn."""
    content = row["prompt"][-1]["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content if p["type"] == "text")


def judge_token_ids(tokenizer) -> tuple[int, int]:
    """The ids of the single tokens ``"yes"`` and ``"no"`` (what follows the assistant prefix)."""
    yes, no = tokenizer.encode(YES, add_special_tokens=False), tokenizer.encode(NO, add_special_tokens=False)
    if len(yes) != 1 or len(no) != 1:
        raise ValueError(f"'yes' / 'no' are not single tokens of this tokenizer ({yes}, {no})")
    return yes[0], no[0]


def judge_scores(model, processor, images: list[Any], captions: list[str], batch_size: int = 64) -> list[float]:
    """P(yes) / (P(yes) + P(no)) per (image, caption): the next-token distribution after the chat template's
    assistant prefix for ``judge_question(caption)``."""
    return yes_probability(model, processor, images, [judge_question(c) for c in captions], batch_size)


def yes_probability(model, processor, images: list[Any], questions: list[str], batch_size: int = 64) -> list[float]:
    """P(yes) / (P(yes) + P(no)) of the next token after the assistant prefix, per (image, question)."""
    import torch

    yes, no = judge_token_ids(processor.tokenizer)
    out: list[float] = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            enc = encode(processor, questions[i:i + batch_size], images[i:i + batch_size])
            logits = model(**enc, logits_to_keep=1).logits[:, -1, :]
            out += torch.softmax(logits[:, [yes, no]].float(), dim=-1)[:, 0].tolist()
    model.train(was_training)
    return out


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unialign.embedded.vlm", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write train.jsonl / test.jsonl + PNG images in TRL's VLM format")
    e.add_argument("--out", required=True, help="output folder")
    e.add_argument("--n-train", type=int, default=None, help="training rows (default: all)")
    e.add_argument("--n-test", type=int, default=None, help="held-out rows (default: all)")
    e.add_argument("--seed", type=int, default=0, help="row order (and the judge's negatives)")
    e.add_argument("--judge", action="store_true", help="add the yes/no judge rows")
    args = ap.parse_args(argv)
    types = QUESTION_TYPES if args.judge else QA_TYPES
    paths = export(args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed, question_types=types)
    for split, path in paths.items():
        print(f"{split}: {sum(1 for _ in path.open())} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
