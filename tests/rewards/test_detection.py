"""ZeroShotDetector on tiny random-weight OWLv2, Grounding DINO and OmDet-Turbo models built in code (saved with
``save_pretrained`` and loaded back by folder, no downloads): the output format, per-image query lists in one
batch, thresholds, batch splitting, input formats, and box / label / score mapping checked against direct
computations from the models' raw outputs; fast offline failure for a Hub id."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from unialign.hub import HubUnavailableError
from unialign.rewards.detection import Detection, ZeroShotDetector

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ tiny models
def _clip_tokenizer(folder: Path, max_length: int):
    """A tiny byte-level CLIP BPE tokenizer: the 256 byte symbols (alone and word-final), no merges, then BOS and
    EOS (the largest id: CLIP pools the text at argmax(ids)). Every string tokenises."""
    from transformers import CLIPTokenizer

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    symbols = [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]  # GPT-2's byte table
    vocab = {c: i for i, c in enumerate(symbols + [c + "</w>" for c in symbols])}
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=max_length,
                         pad_token="<|endoftext|>")


def _clip_text_config(tokenizer, max_length: int, layers: int = 2) -> dict:
    bos, eos = tokenizer.convert_tokens_to_ids(["<|startoftext|>", "<|endoftext|>"])
    return dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_attention_heads=2,
                num_hidden_layers=layers, max_position_embeddings=max_length, bos_token_id=bos, eos_token_id=eos,
                pad_token_id=eos)


def _tiny_swin():
    from transformers import SwinConfig

    return SwinConfig(window_size=7, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], image_size=64,
                      out_features=["stage2", "stage3", "stage4"], out_indices=[2, 3, 4])


def build_owlv2(root: Path) -> Path:
    """An Owlv2ForObjectDetection (ViT 64 px / patch 16 -> 16 patch predictions) + Owlv2Processor folder."""
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    tokenizer = _clip_tokenizer(root / "bpe", 16)
    config = Owlv2Config(
        text_config=_clip_text_config(tokenizer, 16),
        vision_config=dict(image_size=64, patch_size=16, hidden_size=32, intermediate_size=37,
                           num_attention_heads=2, num_hidden_layers=2),
        projection_dim=32)  # = text width, as in the published models (the class head assumes it)
    torch.manual_seed(0)
    model = Owlv2ForObjectDetection(config).eval()
    folder = root / "owlv2"
    model.save_pretrained(folder)  # safetensors
    Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 64, "width": 64}),
                   tokenizer=tokenizer).save_pretrained(folder)
    return folder


# Grounding DINO hard-codes BERT-uncased ids of its phrase separators (SPECIAL_TOKENS = [CLS] 101, [SEP] 102,
# "." 1012, "?" 1029): the tiny vocabulary keeps those ids.
GD_WORDS = ["a", "cat", "dog", "hot", "hair", "drier", "person", "car", "red", "circle"]


def _bert_vocab() -> list[str]:
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    for token, index in ((".", 1012), ("?", 1029)):
        vocab += [f"[unused{i}]" for i in range(len(vocab), index)] + [token]
    return vocab + GD_WORDS


def build_grounding_dino(root: Path) -> Path:
    """A GroundingDinoForObjectDetection (Swin backbone embed 8, BERT 1 layer, d_model 32, 12 queries) +
    GroundingDinoProcessor (BERT tokenizer from a vocab file, images resized to 64..96 px) folder."""
    from transformers import (
        BertConfig,
        BertTokenizer,
        GroundingDinoConfig,
        GroundingDinoForObjectDetection,
        GroundingDinoImageProcessor,
        GroundingDinoProcessor,
    )

    vocab = _bert_vocab()
    (root / "bert").mkdir(parents=True)
    (root / "bert" / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizer(str(root / "bert" / "vocab.txt"))
    text = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=37, max_position_embeddings=64)
    # decoder_layers=2: with 1 the box-head weight tying has nothing to tie to and the model refuses to build
    config = GroundingDinoConfig(
        backbone_config=_tiny_swin(), text_config=text, d_model=32, num_queries=12, encoder_layers=1,
        decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_n_points=2, decoder_n_points=2, max_text_len=64,
        num_feature_levels=3)  # no extra stride-64 level: a 1 x 1 map there breaks GroupNorm on tiny images
    torch.manual_seed(0)
    model = GroundingDinoForObjectDetection(config).eval()
    folder = root / "gdino"
    model.save_pretrained(folder)
    image_processor = GroundingDinoImageProcessor(size={"shortest_edge": 64, "longest_edge": 96})
    GroundingDinoProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def build_omdet(root: Path) -> Path:
    """An OmDetTurboForObjectDetection (Swin backbone, CLIP text 1 layer, 10 queries) + OmDetTurboProcessor."""
    from transformers import (
        DetrImageProcessor,
        OmDetTurboConfig,
        OmDetTurboForObjectDetection,
        OmDetTurboProcessor,
    )

    tokenizer = _clip_tokenizer(root / "bpe_omdet", 77)
    # transformers' Swin backbone returns channels-first maps: no channels-last LayerNorm after it (the hub model
    # uses a timm backbone). decoder_hidden_dim != class_embed_dim as in the published model (the decoder has
    # no task projection otherwise).
    config = OmDetTurboConfig(
        backbone_config=_tiny_swin(), text_config=_clip_text_config(tokenizer, 77, layers=1),
        use_timm_backbone=False, apply_layernorm_after_vision_backbone=False, image_size=64,
        text_projection_in_dim=32, text_projection_out_dim=32, class_embed_dim=32, task_encoder_hidden_dim=32,
        encoder_hidden_dim=16, vision_features_channels=[16, 16, 16], encoder_in_channels=[16, 32, 64],
        encoder_attention_heads=2, encoder_dim_feedforward=32, decoder_hidden_dim=16, decoder_num_heads=2,
        decoder_num_layers=1, decoder_dim_feedforward=32, decoder_num_points=2, num_queries=10)
    torch.manual_seed(0)
    model = OmDetTurboForObjectDetection(config).eval()
    folder = root / "omdet"
    model.save_pretrained(folder)
    OmDetTurboProcessor(image_processor=DetrImageProcessor(size={"height": 64, "width": 64}, do_pad=False),
                        tokenizer=tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zeroshot")
    return {"owlv2": build_owlv2(root), "gdino": build_grounding_dino(root), "omdet": build_omdet(root)}


@pytest.fixture(scope="module")
def detectors(folders) -> dict[str, ZeroShotDetector]:
    return {name: ZeroShotDetector(str(folder), device="cpu") for name, folder in folders.items()}


def _images(sizes=((80, 50), (40, 100), (64, 64)), seed: int = 0) -> list[np.ndarray]:
    """uint8 [H, W, 3] images of the given (width, height): gradients plus noise, non-square."""
    rng = np.random.default_rng(seed)
    out = []
    for w, h in sizes:
        yy, xx = np.mgrid[0:h, 0:w]
        arr = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + 2 * yy) % 256], -1)
        out.append((arr + rng.integers(0, 60, arr.shape)).clip(0, 255).astype(np.uint8))
    return out


QUERIES = [["cat", "dog"], ["red circle"], ["dog", "person", "car"]]


def _assert_well_formed(dets: list[Detection], queries: list[str], width: int, height: int) -> None:
    assert all(isinstance(d, Detection) for d in dets)
    assert {d.label for d in dets} <= set(queries)
    scores = [d.score for d in dets]
    assert all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in scores)
    assert scores == sorted(scores, reverse=True)
    for d in dets:
        x0, y0, x1, y1 = d.box
        assert len(d.box) == 4 and all(isinstance(v, float) for v in d.box)
        assert 0.0 <= x0 <= x1 <= width and 0.0 <= y0 <= y1 <= height


def _flat(boxes) -> list[float]:
    return [float(v) for box in boxes for v in box]


def _same(a: list[list[Detection]], b: list[list[Detection]], tol: float = 1e-5) -> None:
    assert [[d.label for d in im] for im in a] == [[d.label for d in im] for im in b]
    for im_a, im_b in zip(a, b):
        for da, db in zip(im_a, im_b):
            assert da.score == pytest.approx(db.score, abs=tol)
            assert da.box == pytest.approx(db.box, abs=1e-3)
        assert len(im_a) == len(im_b)


# ------------------------------------------------------------------------------------------ format, batches
@pytest.mark.parametrize("name", ["owlv2", "gdino", "omdet"])
def test_format_and_per_image_queries(detectors, name):
    det = detectors[name]
    images = _images()
    found = det(images, QUERIES)
    assert len(found) == len(images)
    for dets, qs, im in zip(found, QUERIES, images):
        _assert_well_formed(dets, qs, im.shape[1], im.shape[0])
    assert all(found), "every image has detections at threshold 0 with these random models"
    # one batch with different query lists == each image alone (the padding of shorter lists changes nothing)
    _same(found, [det([im], [qs])[0] for im, qs in zip(images, QUERIES)])


def test_owlv2_one_detection_per_patch_with_padded_query_lists(detectors):
    """OWLv2 predicts one box per patch ((64/16)^2 = 16) and every one has a real query: the processor's " "
    padding queries (unmasked by the model) never take a patch, whatever the other images ask for."""
    found = detectors["owlv2"](_images(), QUERIES)
    assert [len(dets) for dets in found] == [16, 16, 16]


def test_no_queries_and_blank_queries(detectors):
    det = detectors["owlv2"]
    images = _images()
    found = det(images, [[], ["", "  "], ["dog", "dog", " "]])
    assert found[0] == [] and found[1] == []
    assert found[2] == det([images[2]], [["dog"]])[0]
    with pytest.raises(ValueError, match="query lists"):
        det(images, QUERIES[:2])
    with pytest.raises(TypeError):
        det(images[:1], ["dog"])  # a string, not a list of strings


@pytest.mark.parametrize("name", ["owlv2", "gdino", "omdet"])
def test_threshold_filtering(detectors, name):
    det = detectors[name]
    images, queries = _images(), QUERIES
    base = det(images, queries, threshold=0.0)
    assert det(images, queries, threshold=1.0) == [[], [], []]
    scores = sorted(d.score for dets in base for d in dets)
    kept_before = base
    for t in (scores[len(scores) // 4], scores[len(scores) // 2], scores[3 * len(scores) // 4]):
        kept = det(images, queries, threshold=t)
        assert kept == [[d for d in dets if d.score > t] for dets in base]
        assert all(set(a) <= set(b) for a, b in zip(kept, kept_before))  # raising it only removes detections
        kept_before = kept
    assert 0 < sum(map(len, det(images, queries, threshold=scores[len(scores) // 2]))) < len(scores)


@pytest.mark.parametrize("name", ["owlv2", "gdino", "omdet"])
def test_batch_size_splitting(folders, name):
    """batch_size 1 / 2 give what one batch gives (images of different sizes and query counts mixed)."""
    sizes = ((80, 50), (40, 100), (80, 50), (30, 90), (80, 50))
    images = _images(sizes, seed=1)
    queries = [["cat"], ["dog", "car"], ["person", "cat", "dog"], ["red circle", "dog"], ["car"]]
    whole = ZeroShotDetector(str(folders[name]), device="cpu", batch_size=8)(images, queries)
    for batch_size in (1, 2):
        _same(ZeroShotDetector(str(folders[name]), device="cpu", batch_size=batch_size)(images, queries), whole)


def test_input_formats(detectors):
    det = detectors["owlv2"]
    arrays = _images(((80, 50), (80, 50)), seed=2)
    queries = [["cat", "dog"], ["person"]]
    ref = det([Image.fromarray(a) for a in arrays], queries)
    assert det(arrays, queries) == ref  # uint8 HWC arrays
    chw = [torch.from_numpy(a).permute(2, 0, 1).float() / 255.0 for a in arrays]
    assert det(chw, queries) == ref  # float CHW tensors in [0, 1]
    assert det(torch.stack(chw), queries) == ref  # a float BCHW batch
    rgba = [Image.fromarray(np.concatenate([a, np.full(a.shape[:2] + (1,), 255, np.uint8)], -1)) for a in arrays]
    assert det(rgba, queries) == ref  # any PIL mode is converted to RGB


# ------------------------------------------------------------------------------------------ box / score mapping
def test_owlv2_non_square_boxes_match_raw_predictions(folders, detectors):
    """OWLv2 pads a W x H image to a max(W, H) square (bottom / right) before resizing, so its raw
    ``pred_boxes`` (cx, cy, w, h) are fractions of that square: pixels = fraction * max(W, H) on both axes."""
    from transformers import Owlv2ForObjectDetection, Owlv2Processor

    width, height = 40, 100
    image = Image.fromarray(_images(((width, height),), seed=3)[0])
    processor = Owlv2Processor.from_pretrained(folders["owlv2"])
    model = Owlv2ForObjectDetection.from_pretrained(folders["owlv2"]).eval()
    inputs = processor(text=[["cat"]], images=[image], return_tensors="pt")
    # the padding geometry assumed below: columns right of the image (40/100 of 64 px + blur) are constant
    pixels = inputs["pixel_values"][0]
    assert pixels[:, :, 30:].std(dim=(1, 2)).max() < 1e-5 and pixels[:, :, :20].std() > 0.1
    with torch.no_grad():
        raw = model(**inputs)
    cx, cy, bw, bh = raw.pred_boxes[0].unbind(-1)
    side = max(width, height)
    ref_boxes = torch.stack([((cx - bw / 2) * side).clamp(0, width), ((cy - bh / 2) * side).clamp(0, height),
                             ((cx + bw / 2) * side).clamp(0, width), ((cy + bh / 2) * side).clamp(0, height)], -1)
    ref_scores = torch.sigmoid(raw.logits[0, :, 0])
    order = torch.argsort(ref_scores, descending=True)
    got = detectors["owlv2"]([image], [["cat"]])[0]
    assert len(got) == 16 and all(d.label == "cat" for d in got)
    assert [d.score for d in got] == pytest.approx(ref_scores[order].tolist(), abs=1e-6)
    assert _flat(d.box for d in got) == pytest.approx(_flat(ref_boxes[order].tolist()), abs=1e-3)
    # the test discriminates: scaling x by W and y by H (the classic bug) gives other boxes
    naive = torch.stack([(cx - bw / 2) * width, (cy - bh / 2) * height, (cx + bw / 2) * width,
                         (cy + bh / 2) * height], -1)
    naive = torch.minimum(naive.clamp(min=0), torch.tensor([width, height, width, height]))
    assert (naive - ref_boxes).abs().max() > 5.0


def test_grounding_dino_labels_scores_boxes_match_raw_logits(folders, detectors):
    """Prompt "hot dog. cat." = [CLS] hot dog . cat . [SEP]: "hot dog" owns tokens 1-2, "cat" token 4. A box's
    label is the query with the highest token probability among those with a token above text_threshold
    (none: no detection); its score is that probability; boxes are (cx, cy, w, h) fractions of the image."""
    from transformers import GroundingDinoForObjectDetection, GroundingDinoProcessor

    width, height = 90, 60
    image = Image.fromarray(_images(((width, height),), seed=4)[0])
    processor = GroundingDinoProcessor.from_pretrained(folders["gdino"])
    model = GroundingDinoForObjectDetection.from_pretrained(folders["gdino"]).eval()
    inputs = processor(images=[image], text=["hot dog. cat."], return_tensors="pt")
    vocab = processor.tokenizer.get_vocab()
    assert inputs["input_ids"][0].tolist() == [vocab[t] for t in
                                              ["[CLS]", "hot", "dog", ".", "cat", ".", "[SEP]"]]
    with torch.no_grad():
        raw = model(**inputs)
    probs = torch.sigmoid(raw.logits[0])  # [12, 64]
    per_query = torch.stack([probs[:, 1:3].max(-1).values, probs[:, 4]], -1)  # [12, 2]: hot dog, cat
    cx, cy, bw, bh = raw.pred_boxes[0].unbind(-1)
    boxes = torch.stack([((cx - bw / 2) * width).clamp(0, width), ((cy - bh / 2) * height).clamp(0, height),
                         ((cx + bw / 2) * width).clamp(0, width), ((cy + bh / 2) * height).clamp(0, height)], -1)
    det = detectors["gdino"]
    try:
        for text_threshold in (0.0, float(per_query.median()), float(per_query.quantile(0.8)), 1.0):
            det.text_threshold = text_threshold
            ref = []
            for slot in range(per_query.shape[0]):
                p = per_query[slot]
                candidates = [j for j in range(2) if p[j] > text_threshold]
                if candidates:
                    j = max(candidates, key=lambda k: (p[k], -k))
                    ref.append((["hot dog", "cat"][j], float(p[j]), boxes[slot].tolist()))
            ref.sort(key=lambda r: -r[1])
            got = det([image], [["Hot Dog", "cat"]])[0]  # labels are the queries as passed (not lower-cased)
            assert [d.label for d in got] == [{"hot dog": "Hot Dog"}.get(r[0], r[0]) for r in ref]
            assert [d.score for d in got] == pytest.approx([r[1] for r in ref], abs=1e-6)
            assert _flat(d.box for d in got) == pytest.approx(_flat(r[2] for r in ref), abs=1e-3)
            if text_threshold == 1.0:
                assert got == []
            elif text_threshold > 0.0:
                assert 0 < len(got) < 12  # some boxes had no candidate query
    finally:
        det.text_threshold = 0.25


def test_omdet_boxes_and_scores_match_raw_outputs(folders, detectors):
    """OmDet-Turbo: one (box, class) detection per top-num_queries box x class pair, score = sigmoid(logit),
    boxes = (cx, cy, w, h) fractions of the image; the padding class of a shorter list never appears."""
    from transformers import OmDetTurboForObjectDetection, OmDetTurboProcessor

    width, height = 70, 40
    image = Image.fromarray(_images(((width, height),), seed=5)[0])
    processor = OmDetTurboProcessor.from_pretrained(folders["omdet"])
    model = OmDetTurboForObjectDetection.from_pretrained(folders["omdet"]).eval()
    queries = ["cat", "dog"]
    with torch.no_grad():
        raw = model(**processor(images=[image], text=[queries], return_tensors="pt"))
    logits, coords = raw.decoder_class_logits[0], raw.decoder_coord_logits[0]  # [10, 2], [10, 4]
    ref = []
    for flat in torch.argsort(logits.flatten(), descending=True)[: logits.shape[0]].tolist():
        slot, cls = divmod(flat, logits.shape[1])
        cx, cy, bw, bh = coords[slot].tolist()
        box = [min(max(v, 0.0), lim) for v, lim in zip(
            [(cx - bw / 2) * width, (cy - bh / 2) * height, (cx + bw / 2) * width, (cy + bh / 2) * height],
            [width, height, width, height])]
        ref.append((queries[cls], 1 / (1 + math.exp(-float(logits[slot, cls]))), box))
    got = detectors["omdet"]([image], [queries])[0]
    assert [d.label for d in got] == [r[0] for r in ref]
    assert [d.score for d in got] == pytest.approx([r[1] for r in ref], abs=1e-6)
    assert _flat(d.box for d in got) == pytest.approx(_flat(r[2] for r in ref), abs=1e-3)
    # in a batch with a longer class list, this image's detections are unchanged
    batched = detectors["omdet"]([image, image], [queries, ["person", "car", "red circle"]])
    _same([batched[0]], [got])


# ------------------------------------------------------------------------------------------ loading
def test_offline_hub_id_fails_fast(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    start = time.monotonic()
    with pytest.raises(HubUnavailableError, match="owlv2-base-patch16-ensemble"):
        ZeroShotDetector("google/owlv2-base-patch16-ensemble")
    assert time.monotonic() - start < 5.0


def test_loading_checks(folders, tmp_path):
    from transformers import CLIPConfig

    det = ZeroShotDetector(str(folders["owlv2"]))
    assert det.kind == "owlv2" and not det.model.training
    assert det.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert all(not p.requires_grad for p in det.model.parameters())
    CLIPConfig().save_pretrained(tmp_path / "clip")
    with pytest.raises(ValueError, match="supported kinds"):
        ZeroShotDetector(str(tmp_path / "clip"))
    with pytest.raises(ValueError, match="dtype"):
        ZeroShotDetector(str(folders["owlv2"]), dtype="int8")
    # weights are read from safetensors only: a folder holding only a pickled checkpoint is refused
    pickled = tmp_path / "pickled"
    det.model.config.save_pretrained(pickled)
    det.processor.save_pretrained(pickled)
    torch.save(det.model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        ZeroShotDetector(str(pickled))
