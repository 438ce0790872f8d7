"""The shapes world in GenEval's format: its prompts as GenEval metadata and a pixel-reading detector, the
``"shapes"`` backend of ``unialign.rewards.geneval`` (``--reward_funcs geneval`` on the embedded models).

A prompt "a [size] <colour> <shape> on a <background> background" is the metadata

    {"tag": "color_attr", "include": [{"class": "<shape>", "count": 1, "color": "<colour>"},
                                      {"class": "background", "count": 1, "color": "<background>"}], ...}

-- GenEval's colour-attribution form with the background as a second object (GenEval has no background; this
world's prompts ask for one). The detector is the shape verifier's reading (``shape_verifier.read_image``: the
border's colour, the largest foreground component, its best template and interior colour): the object it found
as one detection of its shape, its colour read from the pixels, and the whole image as the ``background``
detection. So GenEval's rules see what the verifier sees, and the strict verdict is the verifier's
all-three-right on every image (tested), not only on the renderer's clean ones.
"""

from __future__ import annotations

from typing import Any

from unialign.embedded import shapes_world
from unialign.embedded.shape_verifier import SIDE, image_array, parse_shape_prompt, read_image
from unialign.rewards.geneval import Clause, GenEvalMetadata, GenEvalObject

BACKGROUND = "background"


def shapes_metadata(prompt: str, where: str = "prompt") -> GenEvalMetadata:
    """The GenEval metadata of a shapes-world prompt; ValueError naming ``where`` when it does not parse."""
    try:
        want = parse_shape_prompt(prompt)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return GenEvalMetadata("color_attr", (Clause(want.shape, 1, want.colour), Clause(BACKGROUND, 1, want.background)),
                           prompt=prompt)


def _size(image: Any) -> tuple[int, int]:
    """(height, width) of a PIL image, an HWC array or a CHW tensor / array."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.size[1], image.size[0]
    shape = tuple(image.shape)
    return (shape[1], shape[2]) if shape[0] in (1, 3) and shape[-1] not in (1, 3) else (shape[0], shape[1])


class ShapesDetector:
    """The ``"shapes"`` GenEval backend: (PIL images, metadata) -> per image class -> [GenEvalObject] with
    colours (module docstring). An image the verifier rejects (not square, too small, not RGB) has no
    detections."""

    colors = tuple(shapes_world.COLOURS)

    def metadata_from_prompt(self, prompt: Any, where: str = "prompt") -> GenEvalMetadata:
        return shapes_metadata(prompt, where)

    def __call__(self, images: list, metas: list[GenEvalMetadata]) -> list[dict[str, list[GenEvalObject]]]:
        out = []
        for image in images:
            arr = image_array(image)
            if arr is None:
                out.append({})
                continue
            reading = read_image(arr)
            h, w = _size(image)
            objects = {BACKGROUND: [GenEvalObject((0.0, 0.0, float(w), float(h)), 1.0, reading.background)]}
            if reading.found:
                sx, sy = w / SIDE, h / SIDE
                x0, y0, x1, y1 = reading.box
                objects[reading.shape] = [GenEvalObject((x0 * sx, y0 * sy, x1 * sx, y1 * sy), 1.0, reading.colour)]
            out.append(objects)
        return out
