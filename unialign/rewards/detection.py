"""Zero-shot (open-vocabulary) object detection for GenEval-style image rewards.

``ZeroShotDetector(model)`` loads a transformers zero-shot detector (``AutoModelForZeroShotObjectDetection`` +
``AutoProcessor``; the kind comes from ``config.model_type``) and turns images plus per-image text queries
(the class names a prompt asks for) into ``Detection`` s: the query string, a score in [0, 1] and an
``(x0, y0, x1, y1)`` box in pixels of the input image (x right, y down), clipped to the image. The GenEval
scoring (grouping by label, thresholds, NMS, counting, positions, colours) is the caller's: no NMS is done here.

Model kinds and what ``score`` / ``box`` are:

* ``owlv2`` (OWLv2, Minderer et al. 2023) and ``owlvit`` (OWL-ViT): one prediction per image patch, with a
  logit per query. The processor's ``post_process_object_detection`` keeps, per patch, the query with the
  largest logit: ``label`` = that query, ``score`` = ``sigmoid(logit)`` (the per-query class logit; OWLv2's
  separate objectness logit is not used). Several images with different query lists run in one batch: the
  processor pads every list to the longest with ``" "`` queries, which the model does NOT mask (its padding
  test ``input_ids[..., 0] > 0`` never fires: every CLIP-tokenised query starts with BOS), so their logits are
  masked here before post-processing. Boxes: OWLv2's image processor pads each image to a square (bottom
  and right, side ``S = max(H, W)``) before resizing, so ``pred_boxes`` are normalised to that square. The
  normalised corner boxes (post-processing with ``target_sizes=None``) are multiplied by ``S`` on both axes
  (by ``W`` / ``H`` if the image processor has ``do_pad=False``) and clipped to the image -- done here, not by
  ``target_sizes``, because transformers' handling of non-square ``target_sizes`` for OWLv2 changed between
  versions (earlier 4.x releases scaled x by W and y by H, wrong for padded inputs; 5.x scales both by
  max(H, W), wrong when ``do_pad=False``). OWL-ViT resizes (stretches) to a square without padding: boxes
  come from the processor with ``target_sizes=(H, W)``.
* ``grounding-dino`` / ``mm-grounding-dino`` (Grounding DINO, Liu et al. 2023; MM-Grounding-DINO, LLMDet):
  one text per image in the processor's documented format, ``"a cat. a dog."`` (queries lower-cased and
  stripped, "." / "?" inside a query replaced by spaces since the model treats them as phrase separators),
  ``num_queries`` boxes per image, each with a probability ``sigmoid(logit)`` per text token. The processor's
  ``post_process_grounded_object_detection`` (``target_sizes=(H, W)``: boxes are normalised to the unpadded
  image) gives the boxes and a decoded text label = the tokens whose probability exceeds ``text_threshold``.
  Decoded labels do not map back to queries reliably (they include "." and "[SEP]", merge several phrases,
  or hold part of a multi-word query, and "dog" may be the tail of "hot dog"), so the label is mapped by
  token position instead: each query owns its tokens (character offsets of the prompt); a box's candidate
  queries are those with a token above ``text_threshold``; none -> the box is dropped (its text label names
  no query), several -> the query with the highest token probability (the first on ties). ``score`` = that
  query's highest token probability, i.e. the processor's box score (max over all tokens) whenever its best
  token lies in the query's span, and never more than it. Only images of one size share a batch (the
  processor pads a batch to its largest image, and the backbone sees that padding).
* ``omdet-turbo`` (OmDet-Turbo, Zhao et al. 2024): per-image class lists are native. The processor's
  ``post_process_grounded_object_detection`` (``target_sizes=(H, W)``) gives ``(box, class)`` pairs (the top
  ``num_queries`` of all box x class sigmoid scores, so one box may answer several classes): ``score`` =
  ``sigmoid(class logit)``. Its built-in NMS is switched off (``nms_threshold=1.0``) like the other kinds.
  Only images with equally many queries share a batch: the model pads shorter class lists with zero class
  embeddings, which take part in its query selection and, with logit 0, would also fill the post-processing's
  top-``num_queries`` selection before being dropped (leaving no detections for that image). The image
  processor is assumed to resize to a fixed size without padding (the published configs do; the model takes
  no pixel mask).

Loading: a name that is not a local path is checked with ``unialign.hub.require_hub`` first (offline:
``HubUnavailableError`` within seconds). Weights load with ``use_safetensors=True``: nothing is unpickled
(a checkpoint with only ``pytorch_model.bin`` is refused by transformers). ``trust_remote_code`` is False
unless asked. The model runs in eval mode under ``torch.inference_mode()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from unialign.rewards.image import to_pil_images

Tensor = torch.Tensor

OWL_KINDS = ("owlv2", "owlvit")
GROUNDING_DINO_KINDS = ("grounding-dino", "mm-grounding-dino")
OMDET_KINDS = ("omdet-turbo",)
SUPPORTED_KINDS = OWL_KINDS + GROUNDING_DINO_KINDS + OMDET_KINDS


@dataclass(frozen=True)
class Detection:
    """One detected object.

    Attributes:
        label: the query (class name) it answers, exactly as passed in.
        score: confidence in [0, 1] (see the module docstring for each model kind).
        box: ``(x0, y0, x1, y1)`` in pixels of the input image, x right, y down, clipped to the image.
    """

    label: str
    score: float
    box: tuple[float, float, float, float]


def _clean_queries(queries: Any) -> list[str]:
    """The distinct non-blank query strings of one image, in order (a blank query can name nothing)."""
    if isinstance(queries, str):
        raise TypeError(f"queries of an image must be a list of strings, got the string {queries!r}")
    out = []
    for q in queries:
        if not isinstance(q, str):
            raise TypeError(f"a query must be a string, got {type(q).__name__}")
        if q.strip() and q not in out:
            out.append(q)
    return out


def _gdino_phrase(query: str) -> str:
    """A query as a Grounding DINO phrase: "." and "?" (the model's phrase separators) -> spaces, lower-cased."""
    return " ".join(query.replace(".", " ").replace("?", " ").split()).lower()


def _clipped_box(box: list[float], width: int, height: int) -> tuple[float, float, float, float]:
    x0, y0, x1, y1 = (float(v) for v in box)
    w, h = float(width), float(height)
    return min(max(x0, 0.0), w), min(max(y0, 0.0), h), min(max(x1, 0.0), w), min(max(y1, 0.0), h)


class ZeroShotDetector:
    """Zero-shot object detector: ``detector(images, queries) -> detections per image`` (module docstring).

    Args:
        model: Hub id or local folder of a transformers zero-shot detector with its processor; the kind is
            ``config.model_type``, one of ``SUPPORTED_KINDS``.
        device: torch device; None -> "cuda" if available, else "cpu".
        dtype: weights / pixel dtype name ("float32", "float16", "bfloat16"); scores are computed in float32.
        batch_size: images per forward pass (each image keeps its own query list).
        text_threshold: Grounding DINO only: a token probability above it makes its query a candidate label.
        trust_remote_code: passed to transformers (False: only the library's own code runs).
    """

    def __init__(self, model: str, device: str | None = None, dtype: str = "float32", batch_size: int = 8,
                 text_threshold: float = 0.25, trust_remote_code: bool = False) -> None:
        from transformers import AutoConfig, AutoModelForZeroShotObjectDetection, AutoProcessor

        from unialign.hub import is_local, require_hub

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
            raise ValueError(f"dtype must name a torch floating dtype (e.g. 'float32'), got {dtype!r}")
        if is_local(model):
            model = str(Path(model).expanduser())
        else:
            require_hub(model)
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        if config.model_type not in SUPPORTED_KINDS:
            raise ValueError(f"{model!r} is a {config.model_type!r} model; supported kinds: {SUPPORTED_KINDS}")
        self.kind: str = config.model_type
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch_dtype
        self.batch_size = int(batch_size)
        self.text_threshold = float(text_threshold)
        self.processor = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
        self.model = AutoModelForZeroShotObjectDetection.from_pretrained(
            model, config=config, dtype=torch_dtype, use_safetensors=True, trust_remote_code=trust_remote_code)
        self.model.to(self.device).eval().requires_grad_(False)

    # ----------------------------------------------------------------------------------------- public
    def __call__(self, images: list, queries: list[list[str]], threshold: float = 0.0) -> list[list[Detection]]:
        """Detect each image's queries.

        Args:
            images: B images: PIL images (any mode), uint8 [H, W, 3] arrays, float [3, H, W] tensors in [0, 1],
                or one float [B, 3, H, W] tensor (``unialign.rewards.image.to_pil_images``).
            queries: B lists of class names; ``queries[i]`` are searched in image i only. Blank strings are
                ignored; an image without queries gets no detections.
            threshold: keep detections with ``score > threshold``.

        Returns:
            B lists: per image, every detection of one of its queries with score > threshold, sorted by score
            descending (stable; all classes mixed).
        """
        pil = to_pil_images(images)
        if len(queries) != len(pil):
            raise ValueError(f"{len(pil)} images but {len(queries)} query lists")
        cleaned = [_clean_queries(q) for q in queries]
        results: list[list[Detection]] = [[] for _ in pil]
        for index in self._batches(cleaned, [im.size for im in pil]):
            found = self._detect_batch([pil[i] for i in index], [cleaned[i] for i in index], float(threshold))
            for i, dets in zip(index, found):
                results[i] = sorted(dets, key=lambda d: d.score, reverse=True)
        return results

    def _batches(self, queries: list[list[str]], sizes: list[tuple[int, int]]) -> list[list[int]]:
        """Indices of the images with queries, in chunks of at most ``batch_size``, so that an image's
        detections never depend on the other images of its batch:

        * Grounding DINO batches only images of one size: its processor pads a batch to the largest image, and
          the backbone sees the padding (the pixel mask only reaches the position embeddings and attention);
        * OmDet-Turbo batches only images with equally many queries: the model pads shorter class lists with
          zero class embeddings, whose similarity 0 enters its encoder's query selection (a max over classes).

        Generated images usually share one size and prompts ask for 1-4 classes, so batches stay full.
        """
        groups: dict[Any, list[int]] = {}
        for i, (q, size) in enumerate(zip(queries, sizes)):
            if q:
                key = size if self.kind in GROUNDING_DINO_KINDS else len(q) if self.kind in OMDET_KINDS else 0
                groups.setdefault(key, []).append(i)
        return [index[start:start + self.batch_size] for index in groups.values()
                for start in range(0, len(index), self.batch_size)]

    # ----------------------------------------------------------------------------------------- internals
    def _to_device(self, inputs) -> dict[str, Tensor]:
        return {k: (v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device))
                for k, v in inputs.items()}

    @torch.inference_mode()
    def _detect_batch(self, images: list, queries: list[list[str]], threshold: float) -> list[list[Detection]]:
        """images: RGB PIL images; queries: per image, distinct non-blank strings (at least one)."""
        if self.kind in OWL_KINDS:
            return self._detect_owl(images, queries, threshold)
        if self.kind in GROUNDING_DINO_KINDS:
            return self._detect_grounding_dino(images, queries, threshold)
        return self._detect_omdet(images, queries, threshold)

    def _detect_owl(self, images: list, queries: list[list[str]], threshold: float) -> list[list[Detection]]:
        inputs = self.processor(text=[list(q) for q in queries], images=images, return_tensors="pt",
                                truncation=True)
        out = self.model(**self._to_device(inputs))
        logits = out.logits.float()  # [B, num_patches, max_queries]
        counts = torch.tensor([len(q) for q in queries], device=logits.device)
        real = torch.arange(logits.shape[-1], device=logits.device)[None, :] < counts[:, None]  # [B, Q]
        logits = logits.masked_fill(~real[:, None, :], float("-inf"))  # the processor's " " padding queries
        outputs = SimpleNamespace(logits=logits, pred_boxes=out.pred_boxes.float())
        padded = self.kind == "owlv2" and bool(getattr(self.processor.image_processor, "do_pad", True))
        if self.kind == "owlv2":
            target_sizes = None  # normalised corners of the model input; scaled below
        else:
            target_sizes = [(im.height, im.width) for im in images]
        post = self.processor.post_process_grounded_object_detection(
            outputs=outputs, threshold=threshold, target_sizes=target_sizes)
        results = []
        for im, qs, res in zip(images, queries, post):
            w, h = im.width, im.height
            boxes = res["boxes"].float()
            if self.kind == "owlv2":
                side = max(w, h)
                scale = [side] * 4 if padded else [w, h, w, h]
                boxes = boxes * torch.tensor(scale, dtype=boxes.dtype, device=boxes.device)
            dets = []
            for score, label, box in zip(res["scores"].tolist(), res["labels"].tolist(), boxes.tolist()):
                if label < len(qs) and score > threshold:
                    dets.append(Detection(qs[label], float(score), _clipped_box(box, w, h)))
            results.append(dets)
        return results

    def _detect_grounding_dino(self, images: list, queries: list[list[str]],
                               threshold: float) -> list[list[Detection]]:
        prompts, spans = [], []  # spans[b][j]: the character range of query j in prompt b
        for qs in queries:
            text, ranges = "", []
            for q in qs:
                phrase = _gdino_phrase(q)
                ranges.append((len(text), len(text) + len(phrase)))
                text += phrase + ". "
            prompts.append(text.strip())
            spans.append(ranges)
        inputs = self.processor(images=images, text=prompts, return_tensors="pt", padding=True,
                                return_offsets_mapping=True)
        offsets = inputs.pop("offset_mapping")  # [B, L, 2] character offsets of each token (0, 0: special)
        out = self.model(**self._to_device(inputs))
        post = self.processor.post_process_grounded_object_detection(
            out, input_ids=inputs["input_ids"], threshold=-1.0, text_threshold=self.text_threshold,
            target_sizes=[(im.height, im.width) for im in images])  # threshold -1: every box, in slot order
        probs = out.logits.float().sigmoid().cpu()  # [B, num_queries, max_text_len]
        results = []
        for b, (im, qs, res) in enumerate(zip(images, queries, post)):
            start, end = offsets[b, :, 0], offsets[b, :, 1]
            valid = (end > start) & inputs["attention_mask"][b].bool()
            valid[probs.shape[-1]:] = False  # tokens beyond max_text_len were truncated by the model
            query_probs = torch.zeros(probs.shape[1], len(qs))  # [num_queries, Q]: best token of each query
            for j, (lo, hi) in enumerate(spans[b]):
                tokens = (valid & (start >= lo) & (end <= hi)).nonzero().flatten()
                tokens = tokens[tokens < probs.shape[-1]]
                if len(tokens):
                    query_probs[:, j] = probs[b][:, tokens].max(-1).values
            candidate = query_probs > self.text_threshold
            best = query_probs.masked_fill(~candidate, -1.0).max(-1)  # first maximum on ties
            boxes = res["boxes"].float().tolist()
            dets = []
            for slot, (score, label) in enumerate(zip(best.values.tolist(), best.indices.tolist())):
                if candidate[slot].any() and score > threshold:
                    dets.append(Detection(qs[label], float(score), _clipped_box(boxes[slot], im.width, im.height)))
            results.append(dets)
        return results

    def _detect_omdet(self, images: list, queries: list[list[str]], threshold: float) -> list[list[Detection]]:
        inputs = self.processor(images=images, text=[list(q) for q in queries], return_tensors="pt")
        out = self.model(**self._to_device(inputs))
        # every image of the batch has as many classes (``_batches``): no padding classes in the logits
        outputs = SimpleNamespace(decoder_coord_logits=out.decoder_coord_logits.float(),
                                  decoder_class_logits=out.decoder_class_logits.float(),
                                  classes_structure=out.classes_structure)
        post = self.processor.post_process_grounded_object_detection(
            outputs, text_labels=[list(q) for q in queries], threshold=threshold, nms_threshold=1.0,
            target_sizes=[(im.height, im.width) for im in images])
        results = []
        for im, qs, res in zip(images, queries, post):
            dets = []
            for score, label, box in zip(res["scores"].tolist(), res["labels"].tolist(), res["boxes"].tolist()):
                if label < len(qs) and score > threshold:
                    dets.append(Detection(qs[label], float(score), _clipped_box(box, im.width, im.height)))
            results.append(dets)
        return results
