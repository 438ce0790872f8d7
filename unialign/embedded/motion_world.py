"""The offline embedded default for video: the shapes world set in motion, its verifier, and the loader of its tiny
Wan-architecture text-to-video model.

The data
--------
Clips of ``NUM_FRAMES`` (5 = 2 x 2 + 1, a Wan clip length for the embedded VAE's 2x time factor) 32 x 32 frames:
one shape (``SHAPES``: a circle, a bar -- a wide rectangle -- or a column -- a tall one, all of the same area) of
one of the shapes world's 8 colours (``unialign.embedded.shapes_world``) on a background of another colour, moving
in a straight line, at constant speed, in one of four directions (left, right, up, down). Prompts are ``"a red bar
moving left on a blue background"`` (3 x 8 x 7 x 4 = 672); about 1/8 of them, chosen by a hash of the prompt, are
held out of every training stage (``prompts("test")``, 77). Each clip draws its size (``half`` 0.14-0.2 of the
side), its path length (0.3-0.45 of the side over the clip, shortened where a long shape moving along its length
would leave the frame) and where it starts (the whole path inside the frame) from a ``random.Random`` seeded by
(seed, prompt, index): identical on every machine.

Why not the shapes world's circle / square / triangle: at 9-13 px those differ in their corners, which the tiny
model's 8 x 8 latents (4 px cells) do not keep; its clips of that world read every square as a circle and RL could
not teach the shape (``assets/video/BUILD.md``, the first world). A bar, a column and a circle differ in extent,
by whole latent cells.

The verifier
------------
``verify_clips(prompts, videos)`` reads every frame with the shapes world's verifier (``shape_verifier.read_image``:
background, object colour, shape and the object's box), its shape templates this world's (``TEMPLATES``: the
renderer's own circle, bar and column of the object's area and centroid), and the clip as:

* background / colour / shape: the value most frames read (frames where no object was found vote only for the
  background); right when it is the prompt's;
* direction: from the box centre of the first frame to that of the last frame where an object was found, the
  displacement d (pixels); the direction whose unit vector u has the largest d . u, and right when it is the
  prompt's and d . u >= ``MIN_TRAVEL`` px (a still clip moves nowhere) with objects found in at least half the
  frames;
* ``all``: the four right (the fidelity the scripts report); ``credit``: the mean of the parts' partial credit
  (the static parts' ``Reading.credit`` averaged over frames; the direction's softmax of d . u_k /
  ``TRAVEL_SCALE`` at the prompted k, times the share of frames with an object) -- a graded reward for RL.

The model
---------
``assets/video/wan``: a ``WanPipeline`` folder (stock diffusers classes throughout, ``WanPipeline.from_pretrained``
loads it): a ``WanTransformer3DModel`` (patch 1 x 2 x 2, width 64, 2 blocks), a 2-layer ``UMT5EncoderModel`` on the
shapes world's CLIP BPE tokenizer (``shapes_world.write_tokenizer``: every caption word one token), an
``AutoencoderKLWan`` with 4x spatial and 2x temporal compression (5 x 32 x 32 x 3 <-> 8 x 3 x 8 x 8) and a
``FlowMatchEulerDiscreteScheduler``; built by ``python -m tools.build_motion_world`` (numbers in ``BUILD.md`` there).
``load_embedded_wan`` loads it as ``FlowPolicyBase(family=WanFamily)`` with ``SAMPLING_DEFAULTS``.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unialign.embedded import shapes_world

Tensor = torch.Tensor

NAME = "embedded-wan"
WAN_DIR = Path(__file__).resolve().parent / "assets" / "video" / "wan"
NUM_FRAMES = 5
SIDE = shapes_world.IMAGE_SIZE
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
PARTS = ("background", "colour", "shape", "direction")
# The shapes and their half-extents (x, y) in units of the clip's size ``half``: of equal area (pi against
# 4 * 1.3 * 0.6 = 3.12), they differ in extent, not corners (module docstring: why not the shapes world's).
SHAPE_EXTENTS: dict[str, tuple[float, float]] = {"circle": (1.0, 1.0), "bar": (1.3, 0.6), "column": (0.6, 1.3)}
SHAPES = tuple(SHAPE_EXTENTS)
HALF = (0.14, 0.2)        # the size ``half`` of the shape, as a fraction of the side
TRAVEL = (0.3, 0.45)      # path length over the clip, as a fraction of the side
MIN_TRAVEL = 3.0          # pixels the object must move along the prompted direction (the path is 9.6-14.4 px)
TRAVEL_SCALE = 2.0        # pixels: the direction credit's softmax temperature
MAX_SEQUENCE_LENGTH = 16  # text tokens of the embedded UMT5 (a caption is 11 + 2)
SAMPLING_DEFAULTS = dict(num_steps=10, guidance_scale=1.0, noise_level=0.7, sde_type="sde", height=SIDE, width=SIDE,
                         num_frames=NUM_FRAMES, max_sequence_length=MAX_SEQUENCE_LENGTH)


def caption(shape: str, colour: str, background: str, direction: str) -> str:
    """``"a red circle moving left on a blue background"``."""
    return f"a {colour} {shape} moving {direction} on a {background} background"


def _is_test(prompt: str) -> bool:
    return int(hashlib.md5(prompt.encode()).hexdigest(), 16) % 8 == 0


def all_specs() -> list[tuple[str, str, str, str]]:
    """Every (shape, colour, background, direction) with colour != background, in a fixed order."""
    return [(s, c, b, d) for s in SHAPES for c in shapes_world.COLOURS for b in shapes_world.COLOURS if c != b
            for d in DIRECTIONS]


def prompts(split: str = "train") -> list[str]:
    """The prompts of ``split`` ("train", "test" or "all"), in a fixed order."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    out = [caption(*spec) for spec in all_specs()]
    return out if split == "all" else [p for p in out if _is_test(p) == (split == "test")]


def parse_motion_prompt(prompt: str) -> tuple[str, str, str, str]:
    """(shape, colour, background, direction) of a prompt of this world; ValueError naming what is wrong."""
    words = str(prompt).strip().rstrip(".").lower().split()
    if len(words) != 9 or words[0] not in ("a", "an") or words[3] != "moving" or words[5:7] != ["on", "a"] \
            or words[8] != "background":
        raise ValueError(f"{prompt!r} is not 'a <colour> <shape> moving <direction> on a <colour> background'")
    colour, shape, direction, background = words[1], words[2], words[4], words[7]
    for value, allowed, what in ((colour, shapes_world.COLOURS, "colour"), (shape, SHAPES, "shape"),
                                 (direction, DIRECTIONS, "direction"), (background, shapes_world.COLOURS, "colour")):
        if value not in allowed:
            raise ValueError(f"{prompt!r}: {value!r} is not a {what} of this world ({', '.join(allowed)})")
    return shape, colour, background, direction


def render(shape: str, colour: str, background: str, cx: float, cy: float, half: float, size: int = SIDE,
           supersample: int = 4):
    """One anti-aliased PIL RGB frame: ``shape`` centred at (cx, cy), half-extents ``SHAPE_EXTENTS[shape]`` x
    ``half`` (all as fractions of the side), drawn at ``supersample`` x and box-downsampled, as
    ``shapes_world.render``."""
    from PIL import Image, ImageDraw

    if shape not in SHAPE_EXTENTS:
        raise ValueError(f"unknown shape {shape!r} (this world's: {', '.join(SHAPES)})")
    big = size * supersample
    image = Image.new("RGB", (big, big), shapes_world.COLOURS[background])
    draw = ImageDraw.Draw(image)
    ex, ey = SHAPE_EXTENTS[shape]
    x, y, hx, hy = cx * big, cy * big, ex * half * big, ey * half * big
    box = [x - hx, y - hy, x + hx, y + hy]
    fill = shapes_world.COLOURS[colour]
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=fill)
    return image.resize((size, size), Image.BOX)


class Templates:
    """The verifier's shape templates for this world (``shape_verifier.read_image(arr, templates)``): the
    renderer's own anti-aliased coverage of each shape of ``area`` pixels centred at (cy, cx)."""

    shapes = SHAPES

    def __call__(self, shape: str, area: float, cy: float, cx: float) -> np.ndarray:
        ex, ey = SHAPE_EXTENTS[shape]
        unit = np.pi if shape == "circle" else 4.0 * ex * ey  # area of the shape at half = 1
        half = float(np.sqrt(area / unit))
        from unialign.embedded.shape_verifier import coverage_of

        return coverage_of(render(shape, "white", "black", (cx + 0.5) / SIDE, (cy + 0.5) / SIDE, half / SIDE))


TEMPLATES = Templates()


def render_clip(shape: str, colour: str, background: str, direction: str, rng: random.Random,
                frames: int = NUM_FRAMES) -> list:
    """``frames`` PIL frames of ``shape`` moving in a straight line at constant speed in ``direction``
    (module docstring: size, path length and start drawn from ``rng``; a path longer than the frame leaves room
    for is shortened to fit)."""
    half = rng.uniform(*HALF)
    travel = rng.uniform(*TRAVEL)
    ux, uy = DIRECTIONS[direction]
    ex, ey = SHAPE_EXTENTS[shape]
    m_along, m_across = ((ex, ey) if ux else (ey, ex))
    m_along, m_across = m_along * half * 1.1 + 0.02, m_across * half * 1.1 + 0.02
    travel = min(travel, 1 - 2 * m_along)
    along = rng.uniform(m_along, 1 - m_along - travel)  # where the path starts along its axis, the positive way
    across = rng.uniform(m_across, 1 - m_across)
    out = []
    for k in range(frames):
        s = along + travel * k / max(1, frames - 1)
        pos = s if (ux + uy) > 0 else 1 - s  # left / up run the other way along the same axis
        cx, cy = (pos, across) if ux else (across, pos)
        out.append(render(shape, colour, background, cx, cy, half))
    return out


def clip_dataset(split: str = "train", per_prompt: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    """``per_prompt`` clips (``{"prompt", "frames"}``) for every prompt of ``split``, each from its own seeded
    ``random.Random``: deterministic and independent of the other prompts."""
    out = []
    for spec in all_specs():
        prompt = caption(*spec)
        if split != "all" and _is_test(prompt) != (split == "test"):
            continue
        for i in range(per_prompt):
            out.append({"prompt": prompt, "frames": render_clip(*spec, random.Random(f"{seed}:{prompt}:{i}"))})
    return out


def _box_centre(box: tuple[int, int, int, int]) -> np.ndarray:
    x0, y0, x1, y1 = box
    return np.array([(x0 + x1) / 2.0, (y0 + y1) / 2.0])


def read_clip(frames: list) -> dict[str, Any]:
    """What the verifier reads in one clip: per-frame ``readings`` (``shape_verifier.Reading``), the majority
    ``background`` / ``colour`` / ``shape`` and the displacement ``travel`` (pixels, first to last frame with an
    object; None with fewer than two)."""
    from unialign.embedded.shape_verifier import Reading, image_array, read_image

    readings = []
    for frame in frames:
        arr = image_array(frame)
        readings.append(read_image(arr, TEMPLATES) if arr is not None else Reading(None, None, None, valid=False))
    found = [r for r in readings if r.found]

    def majority(values: list) -> Any:
        values = [v for v in values if v is not None]
        return Counter(values).most_common(1)[0][0] if values else None

    travel = _box_centre(found[-1].box) - _box_centre(found[0].box) if len(found) >= 2 else None
    return {"readings": readings, "found": len(found), "background": majority([r.background for r in readings]),
            "colour": majority([r.colour for r in found]), "shape": majority([r.shape for r in found]),
            "travel": travel}


def verify_clips(prompts: list[str], videos: Any, **_columns: Any) -> dict[str, Tensor]:
    """Per-clip checks -> float32 [B] tensors ``background``, ``colour``, ``shape``, ``direction`` (1 right),
    ``all`` (the four right), ``credit`` (partial credit, module docstring). An unparseable prompt raises
    ValueError (check prompts before training); dataset columns are ignored (the prompt says it all)."""
    from unialign.embedded.shape_verifier import ShapePrompt
    from unialign.rewards.video import batch_videos

    wanted = [parse_motion_prompt(p) for p in prompts]
    clips = batch_videos(videos)
    if len(clips) != len(wanted):
        raise ValueError(f"motion_verifier: {len(wanted)} prompts for {len(clips)} videos")
    names = list(DIRECTIONS)
    units = np.array([DIRECTIONS[d] for d in names], dtype=np.float64)
    rows = []
    for (shape, colour, background, direction), frames in zip(wanted, clips):
        got = read_clip(frames)
        enough = got["found"] * 2 >= len(frames)
        d = got["travel"]
        moved = None if d is None else units @ d  # [4] pixels along each direction
        right_way = moved is not None and names[int(moved.argmax())] == direction \
            and moved[names.index(direction)] >= MIN_TRAVEL
        parts = [float(enough and got["background"] == background), float(enough and got["colour"] == colour),
                 float(enough and got["shape"] == shape), float(enough and right_way)]
        want = ShapePrompt(shape=shape, colour=colour, background=background)
        static = np.mean([r.credit(want) for r in got["readings"]], axis=0)  # [3], 0 for frames without an object
        if moved is None:
            move_credit = 0.0
        else:
            logits = moved / TRAVEL_SCALE
            probs = np.exp(logits - logits.max())
            move_credit = float(probs[names.index(direction)] / probs.sum()) * got["found"] / len(frames)
        credit = (float(static.sum()) + move_credit) / 4.0
        rows.append(parts + [float(all(parts)), credit])
    table = torch.tensor(rows, dtype=torch.float32).reshape(-1, 6)
    return {k: table[:, i].contiguous() for i, k in enumerate((*PARTS, "all", "credit"))}


class MotionVerifierReward:
    """``get_reward("motion_verifier")``: the fraction of (background, colour, shape, direction) a clip gets right
    (``verify_clips``); ``partial_credit=True`` (``motion_verifier_partial``) scores its graded ``credit`` instead.
    TRL signature (the completions are videos: lists of frames); the list carries ``metrics``: the batch's
    all-four-right rate (``fidelity``) and each part's rate. A prompt of another world scores 0."""

    name = "motion_verifier"

    def __init__(self, partial_credit: bool = False) -> None:
        self.partial_credit = partial_credit

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        from unialign.rewards.base import ScoreList

        if prompts is None:
            raise TypeError("motion_verifier needs the prompts")
        ok = []
        for p in prompts:
            try:
                parse_motion_prompt(p)
                ok.append(True)
            except ValueError:
                ok.append(False)
        keep = [i for i, good in enumerate(ok) if good]
        scores = ScoreList([0.0] * len(prompts))
        n = len(prompts)
        scores.metrics = {"fidelity": 0.0, **{k: 0.0 for k in PARTS}}
        if keep:
            checks = verify_clips([prompts[i] for i in keep], [completions[i] for i in keep])
            key = "credit" if self.partial_credit else None
            for j, i in enumerate(keep):
                scores[i] = float(checks[key][j]) if key else float(sum(checks[k][j] for k in PARTS) / 4.0)
            scores.metrics = {"fidelity": float(checks["all"].sum()) / n,
                              **{k: float(checks[k].sum()) / n for k in PARTS}}
        return scores


class PartialMotionVerifierReward(MotionVerifierReward):
    """``get_reward("motion_verifier_partial")``: ``MotionVerifierReward(partial_credit=True)``."""

    name = "motion_verifier_partial"

    def __init__(self) -> None:
        super().__init__(partial_credit=True)


def fidelity_checks(prompts: list[str], videos: Any, **columns: Any) -> dict[str, Tensor]:
    """``verify_clips`` as the held-out evaluation reads a verifier: ``all`` and the per-part rates, and beside them
    what the verifier does not read, the clips' frame-to-frame agreement (``smoothness``: 1 - the mean absolute
    pixel change between adjacent frames, ``unialign.rewards.video.TemporalConsistencyReward``; the world's own
    held-out clips: 0.974, at least 0.94): a policy that satisfies the verifier with flickering clips shows here."""
    from unialign.rewards.video import TemporalConsistencyReward

    checks = verify_clips(prompts, videos)
    smooth = torch.tensor(TemporalConsistencyReward("pixel")(prompts, videos), dtype=torch.float32)
    return {**{k: checks[k] for k in (*PARTS, "all", "credit")}, "smoothness": smooth}


def wan_dir(path: str | Path | None = None) -> Path:
    """The embedded Wan folder (``path``, else the shipped one); FileNotFoundError naming the build command."""
    folder = Path(path) if path is not None else WAN_DIR
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"no embedded Wan model in {folder} (build it: python -m tools.build_motion_world "
                                "build)")
    return folder


def load_embedded_wan(path: str | Path | None = None, device: str | torch.device | None = None, **kwargs: Any):
    """The embedded Wan model as ``FlowPolicyBase(family=WanFamily)``, with ``SAMPLING_DEFAULTS`` under
    ``kwargs``."""
    from unialign.image.wan import WanFamily

    return WanFamily.load(str(wan_dir(path)), device=device, **{**SAMPLING_DEFAULTS, **kwargs})
