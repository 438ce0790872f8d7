"""A vision-language model as an image (or video) reward: ask a judge VLM whether image i shows prompt i.

A completion may also be a video (a list of frames, or a batch [B, F, C, H, W]): a judge whose processor takes
videos (the Qwen-VL line) gets a video block, any other one image block per frame; the question says "video".

Two readings of the judge, ``mode``:

* ``"yes_no"`` (default; Janus-Pro-R1's reward): the question (``question``, default ``DEFAULT_QUESTION``,
  ``"Does this image show: {prompt}?"``) is one user message holding the image block and the text, rendered by the
  processor's chat template with the generation prompt; one forward pass, the next-token logits at the last
  position (prompts left-padded, so that is position -1 of every row). Reward = P(yes) / (P(yes) + P(no)),
  computed as ``sigmoid(logsumexp(logits[yes_ids]) - logsumexp(logits[no_ids]))`` (the same number, finite when
  both probabilities underflow). ``yes_ids`` / ``no_ids`` (``yes_no_token_ids``) stand for ``yes_words`` (default
  ``"Yes", "yes", " Yes", " yes"``) / ``no_words``: the words that are **one token** of the vocabulary (all four in
  Qwen2 / Llama-3 style tokenizers); when none of a side's words is, the first token of each word's encoding (a
  character tokenizer: ``Y``, ``y``); words encoding to nothing or to the unknown token skipped, duplicates dropped,
  and an id on both sides (a shared leading-space piece, e.g. ``"▁"`` or ``" "``) dropped from both. P(yes) is the
  total probability of the yes ids (a judge answering ``yes`` rather than ``Yes`` counts too); with one
  word per side it is the plain two-token ratio. Neither side left: ValueError naming the words.
* ``"score"`` (Flow-GRPO's / DiffusionNFT's UnifiedReward reward): greedy decoding of at most ``max_new_tokens``
  tokens; the answer's ``Final Score: x`` (``parse_final_score``) gives x / 5 clamped to [0, 1], an answer without
  one 0. The default question is Flow-GRPO's UnifiedReward prompt (``UNIFIEDREWARD_QUESTION``). Parsing, as
  Flow-GRPO's ``r"Final Score:\\s*([1-5](?:\\.\\d+)?)"`` with ``re.search``: the first match, x in 1..5 with
  optional decimals (``"Final Score: 7"`` is no score). Two differences, both only on answers Flow-GRPO scores
  0 or misreads: the label is matched **case-insensitively** (``"final score: 5.0"`` -> 1.0; pass
  ``case_sensitive=True`` for the published rule) and the number may not run on into more digits
  (``"Final Score: 10"`` is no score, where the published regex reads 1).

The reward returns a ``ScoreList`` (TRL's list of floats) whose ``metrics`` are logged as ``vlm_judge/<name>``:
``unparsed`` (score mode: answers without a score in this call, counted) and ``unparsed_rate``; ``yes_no_mass``
(yes / no mode: the mean probability the judge puts on the yes and no tokens together; near 0 the ratio says
little).

Loading (``model_name_or_path``: a Hub id or a local folder): ``AutoProcessor`` and
``AutoModelForImageTextToText`` with ``use_safetensors=True`` (nothing is unpickled; a checkpoint with only
``pytorch_model.bin`` is refused), ``trust_remote_code`` off unless asked, the weights checked finite
(``unialign.weights.check_finite``), eval mode, no gradients. A Hub id is checked first
(``unialign.hub.require_hub``): offline it fails within seconds, before anything loads.

From the command line (``--reward_funcs vlm_judge``), where a reward name carries no arguments: every argument left
None is read from the environment variable ``UNIALIGN_VLM_JUDGE`` -- a model (Hub id, folder or a ``JUDGE_MODELS``
name), or a JSON object of this class's keyword arguments
(``UNIALIGN_VLM_JUDGE='{"model_name_or_path": "CodeGoat24/UnifiedReward-qwen-7b", "mode": "score"}'``) -- then from
the named judge ``JUDGE_MODELS[model_name_or_path]`` (keyword arguments other packages register under a short
name), then from ``DEFAULTS`` (and ``DEFAULT_MODELS[mode]`` for the model).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

MODES = ("yes_no", "score")
DEFAULT_QUESTION = "Does this image show: {prompt}?"
# Flow-GRPO's UnifiedReward prompt (flow_grpo/rewards.py, unifiedreward_score_sglang), without its leading
# "<image>\n": the image block comes through the chat template here
UNIFIEDREWARD_QUESTION = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in the "
    "caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, assign a score from 1 "
    "to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]")
# the judge each mode loads when none is named: a general instruction-tuned VLM for yes / no, UnifiedReward's
# Qwen2.5-VL fine-tune for the score (Flow-GRPO served UnifiedReward-7b-v1.5, a LLaVA model, through sglang)
DEFAULT_MODELS = {"yes_no": "Qwen/Qwen2.5-VL-7B-Instruct", "score": "CodeGoat24/UnifiedReward-qwen-7b"}
YES_WORDS = ("Yes", "yes", " Yes", " yes")
NO_WORDS = ("No", "no", " No", " no")
ENV_VAR = "UNIALIGN_VLM_JUDGE"
# short names -> keyword arguments (at least "model_name_or_path"); other packages add entries
JUDGE_MODELS: dict[str, dict[str, Any]] = {}
DEFAULTS: dict[str, Any] = {
    "mode": "yes_no", "question": None, "yes_words": YES_WORDS, "no_words": NO_WORDS, "max_new_tokens": 512,
    "resize": None, "case_sensitive": False, "batch_size": 8, "device": None, "torch_dtype": "float32",
    "trust_remote_code": False,
}

_FINAL_SCORE = r"Final Score:\s*([1-5](?:\.\d+)?)(?!\d)"
_FINAL_SCORE_RE = {True: re.compile(_FINAL_SCORE), False: re.compile(_FINAL_SCORE, re.IGNORECASE)}


# ---------------------------------------------------------------------------------------------
# Pure functions: the score parser, the yes / no token ids
# ---------------------------------------------------------------------------------------------
def parse_final_score(text: str, case_sensitive: bool = False) -> float | None:
    """The score of a judge's answer: the x of its first ``Final Score: x`` (x in 1..5, optional decimals, not
    followed by another digit), divided by 5 and clamped to [0, 1]; None when there is none (module docstring).
    ``"Final Score: 4"`` -> 0.8, ``"final score: 5.0"`` -> 1.0 (None with ``case_sensitive``), ``"Final Score:
    7"`` / ``"Final Score: 10"`` / ``"no score"`` -> None."""
    match = _FINAL_SCORE_RE[bool(case_sensitive)].search(text or "")
    if match is None:
        return None
    return min(max(float(match.group(1)) / 5.0, 0.0), 1.0)


def answer_token_ids(tokenizer: Any, words: Sequence[str]) -> list[int]:
    """The token ids that stand for ``words`` as an answer's first token, in order, duplicates dropped: the words
    that are one token of the vocabulary; when none is, the first token of each word's encoding (a character or
    byte tokenizer). Encodings are without special tokens; a word that encodes to nothing or starts with the
    unknown token is skipped."""
    if isinstance(words, str):
        words = [words]
    unk = getattr(tokenizer, "unk_token_id", None)
    encoded = [list(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in words]
    encoded = [e for e in encoded if e and e[0] != unk]
    single = [e for e in encoded if len(e) == 1]
    ids: list[int] = []
    for e in single or encoded:
        if int(e[0]) not in ids:
            ids.append(int(e[0]))
    return ids


def yes_no_token_ids(tokenizer: Any, yes_words: Sequence[str] = YES_WORDS,
                     no_words: Sequence[str] = NO_WORDS) -> tuple[list[int], list[int]]:
    """(yes ids, no ids): ``answer_token_ids`` of each side, an id found on both sides dropped from both.
    Raises ValueError naming the words when a side has none left."""
    yes, no = answer_token_ids(tokenizer, yes_words), answer_token_ids(tokenizer, no_words)
    shared = set(yes) & set(no)
    yes, no = [i for i in yes if i not in shared], [i for i in no if i not in shared]
    for side, words, ids in (("yes", yes_words, yes), ("no", no_words, no)):
        if not ids:
            raise ValueError(f"vlm_judge: the judge's tokenizer has no token for any of the {side} words "
                             f"{list(words)!r} (each word's first token, not the unknown token and not shared with the "
                             f"other side); pass {side}_words=[...] in its vocabulary")
    return yes, no


def _settings(explicit: dict[str, Any]) -> dict[str, Any]:
    """Every argument: the explicit value, else ``ENV_VAR``'s, else the named judge's, else ``DEFAULTS``."""
    from_env: dict[str, Any] = {}
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw.startswith("{"):
        try:
            from_env = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"vlm_judge: {ENV_VAR} is not valid JSON ({err}): {raw[:200]!r}") from None
        unknown = sorted(set(from_env) - set(DEFAULTS) - {"model_name_or_path"}) if isinstance(from_env, dict) else []
        if not isinstance(from_env, dict) or unknown:
            raise ValueError(f"vlm_judge: {ENV_VAR} names unknown arguments {unknown}; known: "
                             f"{['model_name_or_path', *DEFAULTS]}")
    elif raw:
        from_env = {"model_name_or_path": raw}
    name = explicit.get("model_name_or_path") or from_env.get("model_name_or_path")
    named = JUDGE_MODELS.get(name, {}) if isinstance(name, str) else {}
    if named and not named.get("model_name_or_path"):
        raise ValueError(f"vlm_judge: JUDGE_MODELS[{name!r}] names no model_name_or_path: {named!r}")
    out = {key: next((src[key] for src in (explicit, from_env, named) if src.get(key) is not None), DEFAULTS.get(key))
           for key in ("model_name_or_path", *DEFAULTS)}
    if named:  # the short name stands for the registered folder
        out["model_name_or_path"] = named["model_name_or_path"]
    if out["mode"] not in MODES:
        raise ValueError(f"vlm_judge: mode must be one of {MODES}, got {out['mode']!r}")
    if out["model_name_or_path"] is None:
        out["model_name_or_path"] = DEFAULT_MODELS[out["mode"]]
    if out["question"] is None:
        out["question"] = DEFAULT_QUESTION if out["mode"] == "yes_no" else UNIFIEDREWARD_QUESTION
    return out


# ---------------------------------------------------------------------------------------------
# The reward
# ---------------------------------------------------------------------------------------------
class VLMJudgeReward:
    """A judge VLM's verdict on image i against prompt i (module docstring), with TRL's reward signature:
    ``reward(prompts=[str, ...], completions=images) -> ScoreList`` of floats in [0, 1], one per image.
    ``completions`` as the other image rewards take them (``unialign.rewards.image.to_pil_images``): PIL images, a
    uint8 [B,3,H,W] tensor, a float [B,3,H,W] tensor in [0, 1] (rounded to 8 bits), or a list of [3,H,W] / [H,W,3]
    arrays. Prompts are strings or chat messages (their text content). Runs batched (``batch_size`` images per
    forward / ``generate``), left-padded, under ``torch.no_grad()`` on ``device``.

    Args (None: from ``UNIALIGN_VLM_JUDGE``, then ``JUDGE_MODELS``, then these defaults; module docstring):
        model_name_or_path: Hub id or local folder of an ``AutoModelForImageTextToText`` with its processor
            (default ``DEFAULT_MODELS[mode]``), or a ``JUDGE_MODELS`` name.
        mode: ``"yes_no"`` (default) or ``"score"``.
        question: the text asked with the image, ``{prompt}`` replaced by the prompt (default
            ``DEFAULT_QUESTION`` for yes / no, ``UNIFIEDREWARD_QUESTION`` for the score).
        yes_words, no_words: yes / no mode: the answer words whose first tokens are read (``yes_no_token_ids``).
        max_new_tokens: score mode: the answer's length limit (default 512).
        resize: an int S: every image resized to S x S (PIL bicubic) first, as Flow-GRPO does (512) before
            UnifiedReward; default None: as given (the processor resizes as its model expects).
        case_sensitive: score mode: match ``Final Score:`` exactly as Flow-GRPO (default False).
        batch_size: images per forward (default 8).  device: default CUDA when available.
        torch_dtype: weights dtype name (default "float32"; the probabilities are computed in float32).
        trust_remote_code: passed to transformers (default False: only the library's own code runs).
        model, processor: a judge already loaded (both, or neither); given, nothing is loaded and
            ``model_name_or_path`` only names it in messages.
    Raises:
        HubUnavailableError / FileNotFoundError: a Hub id that cannot be reached / a local path that does not exist,
            within seconds and before anything loads.
        ValueError: an unknown mode, a bad ``UNIALIGN_VLM_JUDGE``, a tokenizer without the yes / no words.
    """

    name = "vlm_judge"

    def __init__(self, model_name_or_path: str | None = None, mode: str | None = None, question: str | None = None,
                 yes_words: Sequence[str] | None = None, no_words: Sequence[str] | None = None,
                 max_new_tokens: int | None = None, resize: int | None = None, case_sensitive: bool | None = None,
                 batch_size: int | None = None, device: str | torch.device | None = None,
                 torch_dtype: str | None = None, trust_remote_code: bool | None = None, model: Any = None,
                 processor: Any = None) -> None:
        explicit = {k: v for k, v in locals().items() if k not in ("self", "model", "processor")}
        s = _settings(explicit)
        self.model_name_or_path, self.mode, self.question = str(s["model_name_or_path"]), s["mode"], s["question"]
        if "{prompt}" not in self.question:
            raise ValueError(f"vlm_judge: question must contain '{{prompt}}', got {self.question!r}")
        self.max_new_tokens, self.batch_size = int(s["max_new_tokens"]), int(s["batch_size"])
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError(f"vlm_judge: batch_size and max_new_tokens must be >= 1, got {self.batch_size}, "
                             f"{self.max_new_tokens}")
        self.resize = int(s["resize"]) if s["resize"] is not None else None
        self.case_sensitive = bool(s["case_sensitive"])
        dtype = getattr(torch, str(s["torch_dtype"]), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"vlm_judge: torch_dtype must name a torch floating dtype, got {s['torch_dtype']!r}")
        self.device = torch.device(s["device"] if s["device"] is not None
                                   else ("cuda" if torch.cuda.is_available() else "cpu"))
        if (model is None) != (processor is None):
            raise ValueError("vlm_judge: pass both model= and processor=, or neither")
        if model is None:
            model, processor = _load(self.model_name_or_path, dtype, bool(s["trust_remote_code"]))
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"  # the last position is every row's next token
        # only the last position's logits are needed (a vocabulary of 150k x a long prompt otherwise)
        self._last_only = ({"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters
                           else {})
        self.yes_ids: list[int] = []
        self.no_ids: list[int] = []
        if self.mode == "yes_no":
            self.yes_ids, self.no_ids = yes_no_token_ids(self.tokenizer, s["yes_words"], s["no_words"])

    # ---------------------------------------------------------------- inputs
    @property
    def takes_video(self) -> bool:
        """Whether the judge's processor takes ``videos`` (the Qwen-VL line's video processor); a judge without
        one is shown a video's frames as images."""
        return getattr(self.processor, "video_processor", None) is not None

    def render(self, prompt: str, frames: int = 0) -> str:
        """The judge's input text for one prompt: the question as a user message (the image block -- or, for a
        video of ``frames`` frames, a video block or one image block per frame -- then the text) through the
        processor's chat template, with the generation prompt. A video's question says "video" for "image"."""
        question = self.question.replace("{prompt}", prompt)
        if frames:
            question = re.sub(r"\bimage\b", "video", question)
            blocks = [{"type": "video"}] if self.takes_video else [{"type": "image"}] * frames
        else:
            blocks = [{"type": "image"}]
        messages = [{"role": "user", "content": [*blocks, {"type": "text", "text": question}]}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, prompts: list[str], images: list) -> dict[str, torch.Tensor]:
        """Left-padded processor inputs for prompts and PIL images (one image per prompt) -- or videos (one list
        of PIL frames per prompt) -- on ``device``. The template writes the special tokens itself, so the tokenizer
        adds none."""
        if images and isinstance(images[0], list):  # videos
            texts = [self.render(p, len(v)) for p, v in zip(prompts, images)]
            media = dict(videos=images) if self.takes_video else dict(images=images)
        else:
            texts, media = [self.render(p) for p in prompts], dict(images=[[im] for im in images])
        enc = self.processor(text=texts, padding=True, add_special_tokens=False, return_tensors="pt", **media)
        if not bool(enc["attention_mask"][:, -1].all()):
            raise RuntimeError("vlm_judge: the processor padded on the right; the judge needs left padding")
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in enc.items()}

    def _inputs(self, prompts: list[Any] | None, images: Any) -> tuple[list[str], list]:
        from unialign.rewards.base import completion_to_text
        from unialign.rewards.image import to_pil_images

        if prompts is None:
            raise TypeError("vlm_judge needs the prompts (the question asks about each)")
        texts = [p if isinstance(p, str) else completion_to_text(p) for p in prompts]
        video = (isinstance(images, torch.Tensor) and images.dim() == 5) or (
            isinstance(images, (list, tuple)) and bool(images) and isinstance(images[0], (list, tuple)))
        if video:  # one clip per prompt (unialign.rewards.video's forms): a list of frames each
            from unialign.rewards.video import batch_videos

            pils = [to_pil_images(frames) for frames in batch_videos(images)]
        else:
            pils = to_pil_images(images)
        if len(texts) != len(pils):
            raise ValueError(f"vlm_judge: {len(texts)} prompts for {len(pils)} {'videos' if video else 'images'}")
        if self.resize is not None:
            from PIL import Image

            def resized(im):
                return im.resize((self.resize, self.resize), Image.BICUBIC)

            pils = [[resized(f) for f in v] for v in pils] if video else [resized(im) for im in pils]
        return texts, pils

    # ---------------------------------------------------------------- the two readings
    @torch.no_grad()
    def yes_no(self, prompts: list[Any], images: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(P(yes) / (P(yes) + P(no)), P(yes) + P(no)), float32 [B] each on CPU (module docstring)."""
        texts, pils = self._inputs(prompts, images)
        if not self.yes_ids:
            self.yes_ids, self.no_ids = yes_no_token_ids(self.tokenizer, YES_WORDS, NO_WORDS)
        ratio, mass = [], []
        for i in range(0, len(texts), self.batch_size):
            enc = self.encode(texts[i:i + self.batch_size], pils[i:i + self.batch_size])
            logits = self.model(**enc, **self._last_only).logits[:, -1].float()  # [b, V]
            yes = torch.logsumexp(logits[:, self.yes_ids], -1)
            no = torch.logsumexp(logits[:, self.no_ids], -1)
            ratio.append(torch.sigmoid(yes - no).cpu())
            mass.append(torch.exp(torch.logaddexp(yes, no) - torch.logsumexp(logits, -1)).cpu())
        if not ratio:
            return torch.zeros(0), torch.zeros(0)
        return torch.cat(ratio), torch.cat(mass)

    @torch.no_grad()
    def answers(self, prompts: list[Any], images: Any) -> list[str]:
        """The judge's greedy answers (at most ``max_new_tokens`` tokens, special tokens removed), one per image."""
        texts, pils = self._inputs(prompts, images)
        out: list[str] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.encode(texts[i:i + self.batch_size], pils[i:i + self.batch_size])
            ids = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False, temperature=None,
                                      top_p=None, top_k=None, pad_token_id=self.tokenizer.pad_token_id)
            out += self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return out

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        """B rewards in [0, 1] with the batch's ``metrics`` (module docstring)."""
        from unialign.rewards.base import ScoreList

        if self.mode == "yes_no":
            ratio, mass = self.yes_no(prompts, completions)
            out = ScoreList(ratio.tolist())
            out.metrics = {"yes_no_mass": float(mass.mean()) if len(mass) else math.nan}
            return out
        parsed = [parse_final_score(a, self.case_sensitive) for a in self.answers(prompts, completions)]
        unparsed = sum(p is None for p in parsed)
        out = ScoreList(0.0 if p is None else p for p in parsed)
        out.metrics = {"unparsed": float(unparsed), "unparsed_rate": unparsed / len(parsed) if parsed else math.nan}
        return out


def _load(name: str, dtype: torch.dtype, trust_remote_code: bool):
    """(model, processor) of ``name`` (module docstring: safetensors only, Hub checked first, weights finite)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from unialign.hub import is_local, require_hub
    from unialign.text.policy import hub_error
    from unialign.weights import check_finite

    require_hub(name, "model")  # offline: HubUnavailableError within seconds, before anything loads
    try:
        processor = AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
        model = AutoModelForImageTextToText.from_pretrained(name, dtype=dtype, use_safetensors=True,
                                                            trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        if is_local(name):
            first = str(err).splitlines()[0] if str(err) else ""
            raise RuntimeError(f"vlm_judge: could not load the judge {name!r}: {type(err).__name__}: {first} "
                               "(a folder written by save_pretrained with safetensors weights and its processor)") from None
        raise hub_error(name, err) from None
    check_finite(model, name, "vlm_judge")
    return model, processor
