"""``geneval``: GenEval's compositional verifier as an image reward (Ghosh et al. 2023, arXiv 2310.11513), with
Flow-GRPO's dense training variant (Liu et al. 2025, arXiv 2505.05470; its reward server
``yifan123/reward-server``, ``reward_server/gen_eval.py``).

A prompt comes with GenEval metadata (the format of GenEval's ``evaluation_metadata.jsonl`` and Flow-GRPO's
``dataset/geneval/*_metadata.jsonl``, one JSON object per line, read as dataset columns)::

    {"tag": "color_attr", "prompt": "a photo of a red bench and a blue cat",
     "include": [{"class": "bench", "count": 1, "color": "red"}, {"class": "cat", "count": 1, "color": "blue"}],
     "exclude": [{"class": "bench", "count": 2}]}

``include`` clauses hold together (AND): at least / exactly ``count`` objects of ``class``, optionally of a
``color`` and at a ``position`` ``[relation, index of another include clause]`` (relations: left of, right of,
above, below). ``exclude`` clauses fail when ``count`` or more of ``class`` are found.

The scoring is pure (``geneval_verdict``: detected objects and metadata in, verdicts out). Three numbers per
image:

* ``correct``: GenEval's published verdict (``evaluate``): each include clause finds >= count objects, the
  ``count`` most confident of them have the colour, each is at the relation to every object of the target
  clause; no exclude clause is met.
* ``strict``: Flow-GRPO's strict verdict: exactly ``count`` found and exactly ``count`` of the colour, the same
  position rule; the exclude clauses checked too (Flow-GRPO's server skips them in its strict verdict; GenEval's
  metadata uses exclude only for counting, ``count + 1``, which "exactly count" already implies, so the two
  agree on GenEval's prompts). Logged as the fidelity metric.
* ``score`` (the dense training reward, Flow-GRPO's ``evaluate_reward``): per include clause the count part
  ``1 - |count - found| / count`` (negative when more than twice as many are found, as there), then, when the
  count is wrong and the clause asks for a colour or a position, one 0; when it is right, the colour part
  ``1 - |count - of the colour| / count`` and the position part (1 if every relation holds, else 0; after a
  wrong colour no position part, as there); the mean of all parts. One deliberate difference: Flow-GRPO's
  server appends a 1 after a *failed* position check as well (its ``rewards.append(1.0)`` sits after the
  loop), so a wrong position scores (0 + 1) / 2 there; here a wrong position scores 0.

Detection (``DetectorBackend``): transformers' zero-shot detectors (OWLv2, Grounding DINO, OmDet-Turbo:
``unialign.rewards.detection``) queried with the clause classes; per class the detections above the confidence
threshold (GenEval's 0.3, 0.9 for ``counting`` prompts), the 16 most confident (``MAX_OBJECTS``), no NMS
(GenEval's ``NMS_THRESHOLD = 1``); the colour of a found object by CLIP zero-shot (ViT-L-14 / openai, as GenEval)
over GenEval's ten colours with its three templates on the object's box crop (GenEval composites Mask2Former's
instance mask onto grey first; a box detector has no mask, so the box crop is the whole input). GenEval's
thresholds were set for Mask2Former's scores; a zero-shot detector's scores are calibrated differently, so both
thresholds are arguments.

Backends are registered by name (``GENEVAL_BACKENDS``); the embedded shapes world registers ``"shapes"`` (a
pixel-reading detector: ``unialign.embedded.geneval_shapes``), so ``--reward_funcs geneval`` runs offline there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from unialign.rewards.base import ScoreList

# GenEval's constants (djghosh13/geneval evaluation/evaluate_images.py; the same in Flow-GRPO's reward server)
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")
THRESHOLD = 0.3            # detection confidence kept
COUNTING_THRESHOLD = 0.9   # ... on "counting" prompts
MAX_OBJECTS = 16           # detections kept per class
POSITION_THRESHOLD = 0.1   # relative_position's margin, a share of the two boxes' summed sides
COLOR_TEMPLATES = ("a photo of a {c} {obj}", "a photo of a {c}-colored {obj}", "a photo of a {c} object")


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Clause:
    """One include / exclude clause: ``count`` objects of ``cls``, optionally of ``color`` and at ``position``
    = (relation, index of the target include clause)."""

    cls: str
    count: int
    color: str | None = None
    position: tuple[str, int] | None = None


@dataclass(frozen=True)
class GenEvalMetadata:
    """A prompt's GenEval metadata (module docstring)."""

    tag: str
    include: tuple[Clause, ...]
    exclude: tuple[Clause, ...] = ()
    prompt: str = ""

    @property
    def classes(self) -> list[str]:
        """Every class a clause names, in first-mention order (the detector's queries)."""
        return list(dict.fromkeys(c.cls for c in (*self.include, *self.exclude)))

    @property
    def colour_classes(self) -> set[str]:
        return {c.cls for c in self.include if c.color is not None}

    def as_row(self) -> dict[str, Any]:
        """The metadata as a GenEval ``.jsonl`` row."""
        def clause(c: Clause) -> dict[str, Any]:
            out: dict[str, Any] = {"class": c.cls, "count": c.count}
            if c.color is not None:
                out["color"] = c.color
            if c.position is not None:
                out["position"] = list(c.position)
            return out
        row: dict[str, Any] = {"tag": self.tag, "include": [clause(c) for c in self.include]}
        if self.exclude:
            row["exclude"] = [clause(c) for c in self.exclude]
        row["prompt"] = self.prompt
        return row


def parse_metadata(row: Mapping[str, Any], where: str = "metadata", colors: Sequence[str] | None = COLORS
                   ) -> GenEvalMetadata:
    """Validate a GenEval metadata row (``tag``, ``include``, optional ``exclude``, ``prompt``; ``include`` /
    ``exclude`` may also be JSON strings, as some loaders flatten nested columns). ``colors``: the colour
    vocabulary of the backend (None: any). Raises ValueError naming ``where`` and the field."""
    def fail(msg: str) -> ValueError:
        return ValueError(f"{where}: {msg}")

    if not isinstance(row, Mapping):
        raise fail(f"expected a GenEval metadata object, got {type(row).__name__}")
    tag = row.get("tag")
    if tag not in TAGS:
        raise fail(f"tag {tag!r} is not one of GenEval's {', '.join(TAGS)}")

    def clauses(key: str) -> tuple[Clause, ...]:
        raw = row.get(key) or []
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as err:
                raise fail(f"{key} is a string that is not JSON ({err.msg})") from None
        if not isinstance(raw, list):
            raise fail(f"{key} must be a list of clauses, got {type(raw).__name__}")
        out = []
        for i, c in enumerate(raw):
            name = f"{key}[{i}]"
            if not isinstance(c, Mapping) or not isinstance(c.get("class"), str) or not c["class"].strip():
                raise fail(f"{name} needs a non-empty 'class'")
            count = c.get("count", 1)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise fail(f"{name}.count must be a positive integer, got {count!r}")
            color = c.get("color")
            if color is not None and (not isinstance(color, str) or (colors is not None and color not in colors)):
                raise fail(f"{name}.color {color!r} is not one of {', '.join(colors or ())}")
            position = c.get("position")
            if position is not None:
                ok = (isinstance(position, (list, tuple)) and len(position) == 2 and position[0] in RELATIONS
                      and isinstance(position[1], int) and not isinstance(position[1], bool)
                      and 0 <= position[1] < i and key == "include")
                if not ok:
                    raise fail(f"{name}.position must be [relation, index of an earlier include clause] with "
                               f"relation one of {', '.join(RELATIONS)}, got {position!r}")
                position = (position[0], position[1])
            out.append(Clause(c["class"].strip(), count, color, position))
        return tuple(out)

    include = clauses("include")
    if not include:
        raise fail("include is empty: nothing to verify")
    prompt = row.get("prompt", "")
    return GenEvalMetadata(tag, include, clauses("exclude"), prompt if isinstance(prompt, str) else str(prompt))


# ---------------------------------------------------------------------------------------------
# Scoring (pure)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GenEvalObject:
    """A detected object: ``box`` (x0, y0, x1, y1) in pixels, ``score`` its confidence, ``color`` its colour
    (None when not classified: only objects of classes a clause wants a colour of are)."""

    box: tuple[float, float, float, float]
    score: float = 1.0
    color: str | None = None


@dataclass(frozen=True)
class GenEvalResult:
    correct: bool    # GenEval's verdict
    strict: bool     # Flow-GRPO's strict verdict
    score: float     # the dense reward
    reasons: tuple[str, ...] = ()


def relative_position(box_a: Sequence[float], box_b: Sequence[float], margin: float = POSITION_THRESHOLD) -> set[str]:
    """Relations of box A to box B (GenEval's ``relative_position``): the centre offset, each axis shrunk by
    ``margin`` x the two boxes' summed sides on that axis, normalised by the raw offset's length; "left of" /
    "right of" when its x part is below -0.5 / above 0.5, "above" / "below" likewise for y (y grows downwards).
    Boxes overlapping within the margin on both axes: no relation."""
    a, b = np.asarray(box_a[:4], dtype=np.float64), np.asarray(box_b[:4], dtype=np.float64)
    center_a, center_b = (a[:2] + a[2:]) / 2, (b[:2] + b[2:]) / 2
    dim_a, dim_b = np.abs(a[2:] - a[:2]), np.abs(b[2:] - b[:2])
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - margin * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    rel = set()
    if dx < -0.5:
        rel.add("left of")
    if dx > 0.5:
        rel.add("right of")
    if dy < -0.5:
        rel.add("above")
    if dy > 0.5:
        rel.add("below")
    return rel


def _positions_hold(found: Sequence[GenEvalObject], targets: Sequence[GenEvalObject], relation: str,
                    margin: float) -> bool:
    return all(relation in relative_position(o.box, t.box, margin) for o in found for t in targets)


def geneval_verdict(objects: Mapping[str, Sequence[GenEvalObject]], meta: GenEvalMetadata,
                    margin: float = POSITION_THRESHOLD) -> GenEvalResult:
    """GenEval's verdict, Flow-GRPO's strict verdict and dense score (module docstring) of one image.
    ``objects``: class -> its detections, most confident first (already thresholded and capped)."""
    reasons: list[str] = []
    # GenEval (``evaluate``): >= count, colour / position on the `count` most confident
    correct, groups = True, []
    for c in meta.include:
        found = list(objects.get(c.cls, ()))[:c.count]
        ok = len(found) >= c.count
        if not ok:
            reasons.append(f"expected {c.cls}>={c.count}, found {len(found)}")
        if ok and c.color is not None and sum(o.color == c.color for o in found) < c.count:
            ok = False
            reasons.append(f"expected {c.count} {c.color} {c.cls}, found {sum(o.color == c.color for o in found)}")
        if ok and c.position is not None:
            relation, target = c.position
            if groups[target] is None or not _positions_hold(found, groups[target], relation, margin):
                ok = False
                reasons.append(f"expected {c.cls} {relation} {meta.include[target].cls}")
        correct &= ok
        groups.append(found if ok else None)
    excluded = [c for c in meta.exclude if len(objects.get(c.cls, ())) >= c.count]
    for c in excluded:
        reasons.append(f"expected {c.cls}<{c.count}, found {len(objects.get(c.cls, ()))}")
    correct &= not excluded

    # Flow-GRPO (``evaluate_reward``): == count; the dense parts
    strict, groups, parts = not excluded, [], []
    for c in meta.include:
        found = list(objects.get(c.cls, ()))
        parts.append(1.0 - abs(c.count - len(found)) / c.count)
        ok = len(found) == c.count
        if not ok:
            if c.color is not None or c.position is not None:
                parts.append(0.0)
        else:
            if c.color is not None:
                n_colour = sum(o.color == c.color for o in found)
                parts.append(1.0 - abs(c.count - n_colour) / c.count)
                ok = n_colour == c.count
            if ok and c.position is not None:
                relation, target = c.position
                ok = groups[target] is not None and _positions_hold(found, groups[target], relation, margin)
                parts.append(float(ok))
        strict &= ok
        groups.append(found if ok else None)
    score = sum(parts) / len(parts) if parts else 0.0
    return GenEvalResult(bool(correct), bool(strict), float(score), tuple(reasons))


def keep_detections(detections: Sequence[Any], classes: Sequence[str], threshold: float,
                    max_objects: int = MAX_OBJECTS) -> dict[str, list[GenEvalObject]]:
    """GenEval's filtering of one image's detections (each with ``label``, ``score``, ``box``): per class in
    ``classes`` those with score > ``threshold``, most confident first, at most ``max_objects``; no NMS."""
    out: dict[str, list[GenEvalObject]] = {}
    for cls in classes:
        mine = sorted((d for d in detections if d.label == cls and d.score > threshold), key=lambda d: -d.score)
        if mine:
            out[cls] = [GenEvalObject(tuple(float(v) for v in d.box), float(d.score)) for d in mine[:max_objects]]
    return out


# ---------------------------------------------------------------------------------------------
# Colour (CLIP zero-shot, GenEval's templates)
# ---------------------------------------------------------------------------------------------
class ClipColourClassifier:
    """GenEval's colour of an object: CLIP zero-shot over ``colors`` with ``COLOR_TEMPLATES`` (each colour's
    text embedding the renormalised mean of its templates', as clip_benchmark's ``zero_shot_classifier``), on
    the object's box crop. ``clip``: an object with ``model`` / ``tokenize`` / ``image_size`` / ``mean`` /
    ``std`` (as the other CLIP rewards take) instead of loading ``model_name`` / ``pretrained``."""

    def __init__(self, model_name: str = "ViT-L-14", pretrained: str = "openai", colors: Sequence[str] = COLORS,
                 device: str | torch.device | None = None, batch_size: int = 16, clip: Any = None) -> None:
        from unialign.rewards.image import _ClipReward, _load_open_clip, _resolve_device

        if clip is not None:
            self.clip = _ClipReward(clip.model, clip.tokenize, clip.image_size, clip.mean, clip.std, device,
                                    batch_size)
        else:
            import open_clip

            model, size, mean, std = _load_open_clip(model_name, pretrained, _resolve_device(device))
            self.clip = _ClipReward(model, open_clip.get_tokenizer(model_name), size, mean, std, device, batch_size)
        self.colors = tuple(colors)
        self._weights: dict[str, torch.Tensor] = {}

    def _classifier(self, cls: str) -> torch.Tensor:
        """[D, C] text weights for objects of ``cls``."""
        if cls not in self._weights:
            cols = []
            for c in self.colors:
                e = self.clip.text_embeddings([t.format(c=c, obj=cls) for t in COLOR_TEMPLATES]).mean(0)
                cols.append(torch.nn.functional.normalize(e, dim=-1))
            self._weights[cls] = torch.stack(cols, dim=1)
        return self._weights[cls]

    def __call__(self, image, boxes: Sequence[Sequence[float]], cls: str) -> list[str]:
        """The colour of each box of ``image`` (a PIL image) read as an object of ``cls``."""
        if not boxes:
            return []
        crops = [image.crop(tuple(int(round(v)) for v in _nonempty_box(b, image.size))) for b in boxes]
        logits = self.clip.image_embeddings(crops) @ self._classifier(cls)
        return [self.colors[int(i)] for i in logits.argmax(1)]


def _nonempty_box(box: Sequence[float], size: tuple[int, int]) -> tuple[float, float, float, float]:
    """``box`` clipped to the image and at least one pixel wide and high (a crop PIL can take)."""
    w, h = size
    x0, y0 = min(max(box[0], 0.0), w - 1.0), min(max(box[1], 0.0), h - 1.0)
    return x0, y0, max(min(box[2], float(w)), x0 + 1.0), max(min(box[3], float(h)), y0 + 1.0)


# ---------------------------------------------------------------------------------------------
# Backends: images + metadata -> per-image objects (colours read)
# ---------------------------------------------------------------------------------------------
class DetectorBackend:
    """Zero-shot detector + CLIP colours (module docstring). ``detector``: a hub id or local folder of a
    transformers zero-shot detector (default OWLv2, google/owlv2-base-patch16-ensemble), or an object with the
    ``ZeroShotDetector`` call; ``colour``: a ``ClipColourClassifier`` or its keyword arguments."""

    colors = COLORS

    def __init__(self, detector: Any = "google/owlv2-base-patch16-ensemble", colour: Any = None,
                 threshold: float = THRESHOLD, counting_threshold: float = COUNTING_THRESHOLD,
                 max_objects: int = MAX_OBJECTS, device: str | None = None, batch_size: int = 8) -> None:
        if isinstance(detector, str):
            from unialign.rewards.detection import ZeroShotDetector

            detector = ZeroShotDetector(detector, device=device, batch_size=batch_size)
        self.detector = detector
        self.colour = colour if isinstance(colour, ClipColourClassifier) else \
            ClipColourClassifier(**{"device": device, **(colour or {})})
        self.threshold, self.counting_threshold, self.max_objects = threshold, counting_threshold, max_objects

    def __call__(self, images: list, metas: list[GenEvalMetadata]) -> list[dict[str, list[GenEvalObject]]]:
        """Per image (PIL, uint8 HWC array, float CHW tensor in [0, 1]) class -> detections, colours read."""
        from unialign.rewards.image import to_pil_images

        images = to_pil_images(images)
        low = min(self.threshold, self.counting_threshold)
        raw = self.detector(images, [m.classes for m in metas], threshold=low)
        out = []
        for image, meta, dets in zip(images, metas, raw):
            thr = self.counting_threshold if meta.tag == "counting" else self.threshold
            objects = keep_detections(dets, meta.classes, thr, self.max_objects)
            for cls in meta.colour_classes & set(objects):
                colours = self.colour(image, [o.box for o in objects[cls]], cls)
                objects[cls] = [GenEvalObject(o.box, o.score, c) for o, c in zip(objects[cls], colours)]
            out.append(objects)
        return out


# name -> "module:attribute" of a backend class (built with no arguments); the embedded world adds "shapes"
GENEVAL_BACKENDS: dict[str, str] = {}


# ---------------------------------------------------------------------------------------------
# The reward
# ---------------------------------------------------------------------------------------------
class GenEvalReward:
    """``get_reward("geneval")``: the dense GenEval score (``score="dense"``, the training reward), or the 0 / 1
    ``"strict"`` / ``"correct"`` verdict, of each image against its prompt's metadata. TRL signature; the
    metadata arrive as the dataset columns ``tag`` / ``include`` / ``exclude`` (GenEval's ``.jsonl`` format),
    or, for a backend that reads its own prompts (the shapes world's), from the prompt text. The returned list
    carries ``metrics``: the batch's ``strict`` rate (also as ``fidelity``), ``correct`` rate and mean
    ``dense`` score.

    ``backend``: a registered backend name (``GENEVAL_BACKENDS``: ``"shapes"`` for the embedded world), or
    None for ``DetectorBackend(detector, colour, threshold, counting_threshold, max_objects, device)``."""

    name = "geneval"

    def __init__(self, detector: str = "google/owlv2-base-patch16-ensemble", backend: Any = None,
                 score: str = "dense", threshold: float = THRESHOLD, counting_threshold: float = COUNTING_THRESHOLD,
                 max_objects: int = MAX_OBJECTS, colour: Any = None, device: str | None = None,
                 batch_size: int = 8) -> None:
        if score not in ("dense", "strict", "correct"):
            raise ValueError(f"geneval: score must be dense, strict or correct, got {score!r}")
        self.score = score
        if isinstance(backend, str):
            from unialign.rewards.registry import resolve

            if backend not in GENEVAL_BACKENDS:
                raise ValueError(f"geneval: unknown backend {backend!r}; registered: {sorted(GENEVAL_BACKENDS)}")
            backend = resolve(GENEVAL_BACKENDS[backend])()
        self.backend = backend if backend is not None else DetectorBackend(
            detector, colour, threshold, counting_threshold, max_objects, device, batch_size)

    def metadata(self, prompts: list[Any], tag=None, include=None, exclude=None) -> list[GenEvalMetadata]:
        """One ``GenEvalMetadata`` per prompt, from the columns or (no ``include`` column) the backend's
        ``metadata_from_prompt``; ValueError naming the row otherwise."""
        colors = getattr(self.backend, "colors", COLORS)
        out = []
        for i, p in enumerate(prompts):
            if include is not None:
                row = {"tag": tag[i] if tag is not None else None, "include": include[i],
                       "exclude": exclude[i] if exclude is not None else None, "prompt": p}
                out.append(parse_metadata(row, f"geneval row {i}", colors))
            elif hasattr(self.backend, "metadata_from_prompt"):
                out.append(self.backend.metadata_from_prompt(p, f"geneval row {i}"))
            else:
                raise ValueError(f"geneval row {i}: no GenEval metadata (dataset columns tag / include / exclude) "
                                 f"for prompt {str(p)[:80]!r}")
        return out

    def verdicts(self, prompts: list[Any], images: Any, **columns: Any) -> list[GenEvalResult]:
        """Per image the three verdicts. ``images`` as the other image rewards take them; the backend gets
        them one per list entry, unconverted (the shapes world reads float images at full precision)."""
        metas = self.metadata(prompts, columns.get("tag"), columns.get("include"), columns.get("exclude"))
        if isinstance(images, (torch.Tensor, np.ndarray)):
            images = list(images) if images.ndim == 4 else [images]
        images = list(images)
        if len(images) != len(metas):
            raise ValueError(f"geneval: {len(metas)} prompts for {len(images)} images")
        return [geneval_verdict(objs, m) for objs, m in zip(self.backend(images, metas), metas)]

    def verify(self, prompts: list[Any], images: Any, **columns: Any) -> dict[str, torch.Tensor]:
        """Verdicts in the shape of the shapes world's ``verify`` (a standalone evaluation): float32 [N] ``all``
        (strict), ``correct`` (GenEval's verdict) and ``score`` (dense)."""
        res = self.verdicts(prompts, images, **columns)
        return {"all": torch.tensor([float(r.strict) for r in res]),
                "correct": torch.tensor([float(r.correct) for r in res]),
                "score": torch.tensor([r.score for r in res])}

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **columns: Any) -> list[float]:
        if prompts is None:
            raise TypeError("geneval needs the prompts")
        res = self.verdicts(prompts, completions, **columns)
        pick = {"dense": lambda r: r.score, "strict": lambda r: float(r.strict), "correct": lambda r: float(r.correct)}
        out = ScoreList(pick[self.score](r) for r in res)
        n = max(len(res), 1)
        strict = sum(r.strict for r in res) / n
        out.metrics = {"strict": strict, "fidelity": strict, "correct": sum(r.correct for r in res) / n,
                       "dense": sum(r.score for r in res) / n if res else math.nan}
        return out
