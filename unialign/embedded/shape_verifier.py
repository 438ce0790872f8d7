"""``shape_verifier``: a verifiable image reward for the embedded shapes world (GenEval in miniature).

The image counterpart of the math verifier: it reads what the prompt asks for and checks it in the
pixels, with fixed rules and no learned model. A prompt

    "a [size] [degradation] <colour> <shape> on a <background> background"

(size: small / medium / large; degradation: blurry / faded / noisy / dark; either order, both optional;
colours: the 8 of ``unialign.embedded.shapes_world.COLOURS``; shapes: circle / square / triangle) asks for three
things: the background colour, the object colour and the shape. The score is the fraction of them the
image gets right (0, 1/3, 2/3, 1); ``verify`` also returns each part and the all-three-right flag.

Decision rules (every threshold is a named constant below), on the image as RGB floats in 0..255:

1. **Input.** PIL images (RGB / RGBA / palette), uint8 arrays or tensors, float ones in [0, 1], channels
   first or last. A square image of side >= 16 is box-resized to 32 x 32; anything else (non-square,
   smaller, not 3 channels -- a greyscale image included -- or any non-finite value) is not a valid
   image of this world and scores 0 on all three parts (counted under ``invalid``), never an exception.
2. **Background.** The per-channel median of the ``RING``-pixel border, snapped to the nearest palette
   colour (Euclidean RGB). The renderer keeps every shape off the border.
3. **Object.** The image is smoothed with a 3 x 3 box filter (noise), then split into two colour
   clusters by 2-means, seeded with the median border colour and the pixel farthest from it. Pixels of
   the second cluster form the foreground; the candidate object is its largest 4-connected component.
4. **Shape.** The candidate's soft coverage (each pixel's position between the two cluster colours,
   0..1, within the component grown by one pixel) is compared with the renderer's own anti-aliased
   circle, square and upright triangle of the same area and centroid; the shape is the template with
   the highest soft IoU (sum of minima / sum of maxima).
   **No object** -- the cluster centres closer than ``MIN_CONTRAST``, the component smaller than
   ``MIN_AREA`` or larger than ``MAX_AREA_FRAC`` of the image, or no template reaching ``MIN_SHAPE_IOU``
   (uniform noise reaches at most 0.48) -- scores 0 on **all three** parts, as a detector that finds
   nothing: an image without the object does not show the prompt, and a blank canvas (or noise) in
   the right background colour earns nothing.
5. **Object colour.** The mean colour of the object's interior (its pixels whose 4 neighbours are all
   object), of the unsmoothed image, snapped to the nearest palette colour.

Measured (``tests/rewards/test_shapes.py`` holds floors under each): on the renderer's clean images of
all 168 prompts x 4 layouts (every size) all three parts are right 100 % of the time; on degraded
renders (strength uniform in [0.5, 1]) all-three-right is 0.96 for blurry, 0.99 for noisy, 0.51 for
faded and 0.10 for dark. Faded and dark move the colours 40-80 % of the way to grey or black, where the
nearest palette colour is often another one: the verifier reads the colour it sees, not the one the
prompt meant (the shape is still read: 0.89 / 0.94). The embedded policies are prompted without
degradation words, so neither limit touches the training signal.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from unialign.embedded import shapes_world
from unialign.rewards.base import ScoreList

logger = logging.getLogger(__name__)

SIDE = 32                 # the embedded world's image side; larger square images are box-resized to it
MIN_SIDE = 16
RING = 3                  # width in pixels of the border ring that votes for the background
MIN_CONTRAST = 40.0       # RGB distance between object and background cluster centres (0..441)
MIN_AREA = 6              # object pixels (a "small" circle has ~80)
MAX_AREA_FRAC = 0.8       # of the image (a "large" circle covers up to 66 %)
MIN_SHAPE_IOU = 0.6       # soft IoU with the best-fitting template (uniform noise: at most 0.48)
COLOUR_SCALE = 30.0       # partial credit: RGB distance scale of the colour softmax
SHAPE_SCALE = 0.05        # partial credit: soft-IoU scale of the shape softmax
PARTS = ("background", "colour", "shape")
SIZE_WORDS = ("small", "medium", "large")
DEGRADATION_WORDS = ("blurry", "faded", "noisy", "dark")


@dataclass(frozen=True)
class ShapePrompt:
    """What a prompt of the shapes world asks for."""

    colour: str
    shape: str
    background: str
    size: str | None = None
    degradation: str | None = None


def parse_shape_prompt(prompt: str) -> ShapePrompt:
    """Parse ``"a [size] [degradation] <colour> <shape> on a <background> background"`` (size and
    degradation in either order, case and surrounding whitespace ignored, an optional final period).
    Raises ``ValueError`` naming the prompt and the expected form when it does not match."""
    world = shapes_world
    colours, shapes = "|".join(world.COLOURS), "|".join(world.SHAPES)
    adjectives = "|".join(SIZE_WORDS + DEGRADATION_WORDS)
    pattern = (rf"an? ((?:(?:{adjectives}) ){{0,2}})({colours}) ({shapes}) on an? ({colours}) background\.?")
    text = " ".join(str(prompt).lower().split()) if isinstance(prompt, str) else None
    match = re.fullmatch(pattern, text) if text is not None else None
    if match is None:
        raise ValueError(f"shape_verifier: cannot parse prompt {str(prompt)[:80]!r}; expected 'a [size] "
                         f"[degradation] <colour> <shape> on a <background> background' with colours "
                         f"{', '.join(world.COLOURS)} and shapes {', '.join(world.SHAPES)}")
    words = match.group(1).split()
    sizes = [w for w in words if w in SIZE_WORDS]
    degradations = [w for w in words if w in DEGRADATION_WORDS]
    if len(sizes) > 1 or len(degradations) > 1:
        raise ValueError(f"shape_verifier: prompt {prompt!r} names more than one size or degradation")
    colour, shape, background = match.group(2), match.group(3), match.group(4)
    if colour == background:
        raise ValueError(f"shape_verifier: prompt {prompt!r} asks for a {colour} object on a {colour} background")
    return ShapePrompt(colour, shape, background, sizes[0] if sizes else None,
                       degradations[0] if degradations else None)


# ---------------------------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------------------------
def image_array(image: Any) -> np.ndarray | None:
    """One image -> float64 [SIDE, SIDE, 3] in 0..255, or None when it is not a valid image of the world
    (rule 1 of the module docstring)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        if image.mode not in ("RGB", "RGBA", "P"):
            return None
        arr = np.asarray(image.convert("RGB"), dtype=np.float64)
    else:
        if isinstance(image, torch.Tensor):
            image = image.detach().to("cpu")
            image = image.numpy() if image.dtype == torch.uint8 else image.double().numpy()
        arr = np.asarray(image)
        if arr.ndim != 3 or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
            return None
        if arr.shape[0] == 3 and arr.shape[-1] != 3:
            arr = arr.transpose(1, 2, 0)
        if arr.shape[-1] != 3:
            return None
        if arr.dtype == np.uint8:
            arr = arr.astype(np.float64)
        else:
            arr = arr.astype(np.float64)
            if not np.isfinite(arr).all():
                return None
            arr = np.clip(arr, 0.0, 1.0) * 255.0
    h, w = arr.shape[:2]
    if h != w or h < MIN_SIDE:
        return None
    if h != SIDE:
        pil = Image.fromarray(np.clip(arr, 0, 255).round().astype(np.uint8), "RGB")
        arr = np.asarray(pil.resize((SIDE, SIDE), Image.BOX), dtype=np.float64)
    return arr


# ---------------------------------------------------------------------------------------------
# Pixel rules
# ---------------------------------------------------------------------------------------------
def _palette() -> tuple[list[str], np.ndarray]:
    colours = shapes_world.COLOURS
    return list(colours), np.array(list(colours.values()), dtype=np.float64)


def nearest_colour(rgb_N_3: np.ndarray) -> np.ndarray:
    """Index into the palette of the nearest colour (Euclidean RGB) of each row. [N]"""
    _, palette = _palette()
    return ((rgb_N_3[:, None, :] - palette[None]) ** 2).sum(-1).argmin(1)


def _box3(arr: np.ndarray) -> np.ndarray:
    padded = np.pad(arr, ((1, 1), (1, 1), (0, 0)), mode="edge")
    h, w = arr.shape[:2]
    return sum(padded[i:i + h, j:j + w] for i in range(3) for j in range(3)) / 9.0


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """Largest 4-connected component of a boolean mask (breadth-first search; 32 x 32 is tiny)."""
    h, w = mask.shape
    seen = np.zeros_like(mask)
    best: list[tuple[int, int]] = []
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        seen[start] = True
        queue, comp = deque([start]), []
        while queue:
            y, x = queue.popleft()
            comp.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        if len(comp) > len(best):
            best = comp
    out = np.zeros_like(mask)
    if best:
        ys, xs = zip(*best)
        out[list(ys), list(xs)] = True
    return out


def _grow(mask: np.ndarray) -> np.ndarray:
    out = mask.copy()
    out[1:] |= mask[:-1]
    out[:-1] |= mask[1:]
    out[:, 1:] |= mask[:, :-1]
    out[:, :-1] |= mask[:, 1:]
    return out


def _interior(mask: np.ndarray) -> np.ndarray:
    padded = np.pad(mask, 1)
    return mask & padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]


def _template(shape: str, area: float, cy: float, cx: float) -> np.ndarray:
    """The renderer's anti-aliased coverage of ``shape`` with ``area`` pixels, centroid (cy, cx)."""
    world = shapes_world
    if shape == "circle":
        half = np.sqrt(area / np.pi)
        centre_y = cy
    elif shape == "square":
        half = np.sqrt(area) / 2 / 0.9         # the renderer's square has half-side 0.9 * half
        centre_y = cy
    else:                                      # apex (0, -h), base at +0.8 h, width 2.2 h: area 1.98 h^2
        half = np.sqrt(area / 1.98)
        centre_y = cy - 0.2 * half             # the triangle's centroid sits 0.2 h below its box centre
    return coverage_of(world.render(shape, "white", "black", (cx + 0.5) / SIDE, (centre_y + 0.5) / SIDE, half / SIDE))


def coverage_of(white_on_black: Any) -> np.ndarray:
    """[SIDE, SIDE] coverage 0..1 of a shape the renderer drew white (245) on black (15): a template."""
    return (np.asarray(white_on_black, dtype=np.float64)[..., 0] - 15.0) / 230.0


def _soft_iou(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.minimum(a, b).sum() / max(np.maximum(a, b).sum(), 1e-9))


@dataclass(frozen=True)
class Reading:
    """What the verifier read in one image: the background always, colour and shape only when it found
    an object (``shape_iou`` is the best template's soft IoU); ``valid`` False for a rejected input."""

    background: str | None
    colour: str | None
    shape: str | None
    shape_iou: float = 0.0
    valid: bool = True
    background_rgb: np.ndarray | None = None   # the statistics the decisions snap or take the argmax of
    colour_rgb: np.ndarray | None = None
    shape_ious: dict[str, float] | None = None
    box: tuple[int, int, int, int] | None = None  # the object's bounding box (x0, y0, x1, y1) on the SIDE grid

    @property
    def found(self) -> bool:
        return self.shape is not None

    def credit(self, want: ShapePrompt) -> list[float]:
        """Partial credit per part: the probability of the prompted value under a softmax of the same
        statistics the decisions take the argmax of -- colours: -||rgb - palette||^2 / (2 COLOUR_SCALE^2),
        shape: soft IoU / SHAPE_SCALE. Zero for all three when no object was found, as the hard rule."""
        if not self.found:
            return [0.0, 0.0, 0.0]
        names, palette = _palette()
        parts = []
        for rgb, wanted in ((self.background_rgb, want.background), (self.colour_rgb, want.colour)):
            logits = -((palette - rgb) ** 2).sum(1) / (2 * COLOUR_SCALE**2)
            parts.append(float(_softmax(logits)[names.index(wanted)]))
        shapes = list(self.shape_ious)
        probs = _softmax(np.array([self.shape_ious[k] for k in shapes]) / SHAPE_SCALE)
        return parts + [float(probs[shapes.index(want.shape)])]


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


def read_image(arr: np.ndarray, templates: Any = None) -> Reading:
    """Apply rules 2-5 to one image from ``image_array``. ``templates``: the shapes to compare, as a callable
    ``(shape, area, cy, cx) -> coverage [SIDE, SIDE]`` with a ``shapes`` tuple (another world's shapes, e.g. the
    motion world's); default this world's circle / square / triangle (``_template``)."""
    template = _template if templates is None else templates
    shapes = shapes_world.SHAPES if templates is None else templates.shapes
    names, _ = _palette()
    ring = np.ones((SIDE, SIDE), dtype=bool)
    ring[RING:-RING, RING:-RING] = False
    background_rgb = np.median(arr[ring], axis=0)
    background = names[int(nearest_colour(background_rgb[None])[0])]
    empty = Reading(background, None, None, background_rgb=background_rgb)

    smooth = _box3(arr)
    flat = smooth.reshape(-1, 3)
    bg_c = background_rgb
    fg_c = flat[((flat - bg_c) ** 2).sum(1).argmax()]
    for _ in range(10):  # 2-means, seeded with the border colour and the farthest pixel
        is_fg = ((flat - fg_c) ** 2).sum(1) < ((flat - bg_c) ** 2).sum(1)
        if is_fg.all() or not is_fg.any():
            break
        fg_c, bg_c = flat[is_fg].mean(0), flat[~is_fg].mean(0)
    contrast = float(np.linalg.norm(fg_c - bg_c))
    if contrast < MIN_CONTRAST:
        return empty
    fg = ((smooth - fg_c) ** 2).sum(-1) < ((smooth - bg_c) ** 2).sum(-1)
    comp = _largest_component(fg)
    area_px = int(comp.sum())
    if area_px < MIN_AREA or area_px > MAX_AREA_FRAC * SIDE * SIDE:
        return empty

    axis = fg_c - bg_c
    coverage = ((arr - bg_c) @ axis / (axis @ axis)).clip(0.0, 1.0) * _grow(comp)
    area = float(coverage.sum())
    ys, xs = np.mgrid[0:SIDE, 0:SIDE]
    cy, cx = float((coverage * ys).sum() / area), float((coverage * xs).sum() / area)
    ious = {s: _soft_iou(coverage, template(s, area, cy, cx)) for s in shapes}
    shape, iou = max(ious.items(), key=lambda kv: kv[1])
    if iou < MIN_SHAPE_IOU:
        return Reading(background, None, None, iou, background_rgb=background_rgb)

    core = _interior(comp)
    colour_rgb = arr[core if core.sum() >= 3 else comp].mean(0)
    colour = names[int(nearest_colour(colour_rgb[None])[0])]
    rows, cols = np.nonzero(comp)
    box = (int(cols.min()), int(rows.min()), int(cols.max()) + 1, int(rows.max()) + 1)
    return Reading(background, colour, shape, iou, background_rgb=background_rgb, colour_rgb=colour_rgb,
                   shape_ious=ious, box=box)


def verify(prompts: list[str], images: Any, **_columns: Any) -> dict[str, torch.Tensor]:
    """Per-image checks -> float32 [B] tensors ``background``, ``colour``, ``shape`` (1 right, 0 wrong),
    ``all`` (all three right), ``score`` (their mean), ``credit`` (the mean of the parts' partial
    credit, ``Reading.credit``), ``invalid`` (1 where the image was not valid). A prompt that does not
    parse raises ``ValueError`` (check prompts before training). Dataset columns are accepted and ignored (the
    prompt says it all)."""
    from unialign.rewards.image import to_pil_images

    wanted = [parse_shape_prompt(p) for p in prompts]
    if isinstance(images, (torch.Tensor, np.ndarray)) and images.ndim == 4:
        images = list(images)
    if isinstance(images, (torch.Tensor, np.ndarray)):
        images = to_pil_images(images)
    if len(images) != len(wanted):
        raise ValueError(f"shape_verifier: {len(wanted)} prompts for {len(images)} images")
    rows = []
    for want, image in zip(wanted, images):
        arr = image_array(image)
        got = read_image(arr) if arr is not None else Reading(None, None, None, valid=False)
        parts = [float(got.found and got.background == want.background), float(got.found and got.colour == want.colour),
                 float(got.found and got.shape == want.shape)]
        rows.append(parts + [float(all(parts)), sum(parts) / 3.0, sum(got.credit(want)) / 3.0, float(not got.valid)])
    table = torch.tensor(rows, dtype=torch.float32).reshape(-1, 7)
    return {k: table[:, i].contiguous() for i, k in enumerate((*PARTS, "all", "score", "credit", "invalid"))}


class ShapeVerifierReward:
    """``get_reward("shape_verifier")``: the fraction of (background colour, object colour, shape) that
    the image gets right (module docstring). TRL signature; any extra dataset columns are ignored.

    ``partial_credit=True`` (registered as ``shape_verifier_partial``) scores each part by the probability
    of the prompted value under a softmax of the statistics the rules take the argmax of
    (``Reading.credit``) instead of 0 / 1: the same decisions, graded. A policy-gradient reward needs
    the grading -- measured on the embedded model, two independent 128-sample batches' policy gradients
    point the same way with cosine 0.20-0.33 under partial credit and -0.10-0.15 under 0 / 1 (reward
    flips only where a sample crosses a decision boundary; the brightness of the image, for scale: 0.8).

    An unparseable prompt scores 0 with one warning per prompt (the loop goes on; scripts check their
    prompts with ``parse_shape_prompt`` before loading a model). The returned list carries ``metrics``
    (always the 0 / 1 rules): the batch's all-three-right rate (``fidelity``), each part's rate, and the
    invalid-image count."""

    name = "shape_verifier"

    def __init__(self, partial_credit: bool = False) -> None:
        self.partial_credit = partial_credit
        self._warned: set[str] = set()

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        if prompts is None:
            raise TypeError("shape_verifier needs the prompts")
        ok = []
        for p in prompts:
            try:
                parse_shape_prompt(p)
                ok.append(True)
            except ValueError as exc:
                if str(p) not in self._warned:
                    self._warned.add(str(p))
                    logger.warning("%s; scored 0", exc)
                ok.append(False)
        images = list(completions) if isinstance(completions, (torch.Tensor, np.ndarray)) else completions
        keep = [i for i, good in enumerate(ok) if good]
        scores = ScoreList([0.0] * len(prompts))
        if keep:
            checks = verify([prompts[i] for i in keep], [images[i] for i in keep])
            key = "credit" if self.partial_credit else "score"
            for j, i in enumerate(keep):
                scores[i] = float(checks[key][j])
            n = len(prompts)
            scores.metrics = {"fidelity": float(checks["all"].sum()) / n,
                              **{k: float(checks[k].sum()) / n for k in PARTS},
                              "invalid": float(checks["invalid"].sum()) + (n - len(keep))}
        else:
            scores.metrics = {"fidelity": 0.0, **{k: 0.0 for k in PARTS}, "invalid": float(len(prompts))}
        return scores


class PartialShapeVerifierReward(ShapeVerifierReward):
    """``get_reward("shape_verifier_partial")``: ``ShapeVerifierReward(partial_credit=True)``."""

    name = "shape_verifier_partial"

    def __init__(self) -> None:
        super().__init__(partial_credit=True)
