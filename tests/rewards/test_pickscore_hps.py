"""PickScore and HPSv2 reward plugins on tiny random-weight models of the published architectures (a
transformers CLIPModel + CLIP processor saved to a folder; an open_clip CLIP from a model config JSON plus
an HPS-format checkpoint), each scored against an independent restatement of the published computation;
prompt pairing, batching, loading from a folder / file / the registry, and fast offline failure."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from unialign.rewards import get_reward
from unialign.rewards.image import HPS_FILENAMES, HpsReward, PickScoreReward

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
PROMPTS = ["a red circle", "a blue square on a green background", "cat", "two small yellow triangles", "x"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _images(n: int = len(PROMPTS)) -> list[Image.Image]:
    """Non-square, non-symmetric images of different sizes: resize and crop offsets matter. 303 x 250 gives
    a crop offset of 23.5 px, where floor (transformers) and round (torchvision) differ."""
    rng = np.random.default_rng(0)
    sizes = [(303, 250), (250, 303), (224, 224), (400, 260), (231, 380)]
    out = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        yy, xx = np.mgrid[0:h, 0:w]
        arr = np.stack([xx * 255 // (w - 1), yy * 255 // (h - 1), ((xx // (5 + i) + yy // 3) % 2) * 180 + 30], -1)
        arr = (arr + rng.integers(0, 40, arr.shape)).clip(0, 255)
        out.append(Image.fromarray(arr.astype(np.uint8)))
    return out


# ------------------------------------------------------------------------------------------ PickScore
def tiny_pickscore(root) -> dict[str, str]:
    """``PickScoreReward`` kwargs (model, processor) of a CLIPModel with PickScore's (CLIP-H) layout shrunk to
    width 32, and a processor folder with laion/CLIP-ViT-H-14-laion2B-s32B-b79K's preprocessor settings and a
    tiny CLIP BPE tokenizer, written under ``root``. logit_scale = ln 100 (PickScore's value), so the scale
    is visible in the score."""
    from transformers import CLIPConfig, CLIPModel

    from unialign.embedded.shapes_world import load_tokenizer, write_tokenizer
    from unialign.rewards.image import _clip_image_processor_pil

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(write_tokenizer(root / "bpe"))
    tokenizer.model_max_length = 77
    processor_dir = root / "processor"
    tokenizer.save_pretrained(processor_dir)
    (processor_dir / "preprocessor_config.json").write_text(json.dumps({  # the laion CLIP-H values
        "crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "do_convert_rgb": True,
        "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": list(OPENAI_MEAN),
        "image_std": list(OPENAI_STD), "resample": 3, "rescale_factor": 1 / 255, "size": {"shortest_edge": 224},
        "image_processor_type": "CLIPImageProcessor"}))
    assert _clip_image_processor_pil(str(processor_dir)).resample == 3
    ids = tokenizer.convert_tokens_to_ids(["<|startoftext|>", "<|endoftext|>"])
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_attention_heads=2,
                         num_hidden_layers=2, max_position_embeddings=77, bos_token_id=ids[0], eos_token_id=ids[1],
                         pad_token_id=ids[1], hidden_act="gelu"),
        vision_config=dict(image_size=224, patch_size=32, hidden_size=32, intermediate_size=37,
                           num_attention_heads=2, num_hidden_layers=2, hidden_act="gelu"),
        projection_dim=16)
    torch.manual_seed(0)
    model = CLIPModel(config)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0))
    model.save_pretrained(root / "model")  # safetensors
    assert (root / "model" / "model.safetensors").is_file()
    return {"model": str(root / "model"), "processor": str(processor_dir)}


@pytest.fixture(scope="module")
def pickscore_dirs(tmp_path_factory):
    """(model dir, processor dir) of ``tiny_pickscore``."""
    kwargs = tiny_pickscore(tmp_path_factory.mktemp("pickscore"))
    return kwargs["model"], kwargs["processor"]


def _pickscore_pixels(image: Image.Image) -> torch.Tensor:
    """CLIPImageProcessor (PIL) by hand: shortest side -> 224 with PIL bicubic (long side int(224 * l / s)),
    center crop at floor((size - 224) / 2), / 255, CLIP mean/std -> [3, 224, 224] float64."""
    w, h = image.size
    if w <= h:
        new = (224, int(224 * h / w))
    else:
        new = (int(224 * w / h), 224)
    arr = np.asarray(image.convert("RGB").resize(new, Image.BICUBIC), dtype=np.float64) / 255.0
    top, left = (arr.shape[0] - 224) // 2, (arr.shape[1] - 224) // 2
    arr = (arr[top:top + 224, left:left + 224] - np.array(OPENAI_MEAN)) / np.array(OPENAI_STD)
    return torch.from_numpy(arr).permute(2, 0, 1)


def _pickscore_reference(model_dir, processor_dir, prompts, images) -> torch.Tensor:
    """The PickScore README's computation, restated on the model's submodules (not get_*_features), one
    prompt at a time: logit_scale.exp() * cos(text_emb, image_emb), float64."""
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(model_dir).double().eval()
    tokenizer = AutoTokenizer.from_pretrained(processor_dir)
    out = []
    with torch.no_grad():
        for prompt, image in zip(prompts, images):
            pixels = _pickscore_pixels(image)[None]
            img = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
            tokens = tokenizer([prompt], truncation=True, max_length=77, return_tensors="pt")
            txt = model.text_projection(model.text_model(**tokens).pooler_output)
            img, txt = img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)
            out.append(model.logit_scale.exp() * (txt @ img.T)[0, 0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def pickscore(pickscore_dirs):
    model_dir, processor_dir = pickscore_dirs
    return PickScoreReward(model=model_dir, processor=processor_dir, device="cpu", batch_size=2)


def test_pickscore_preprocessing_is_the_published_processor(pickscore):
    images = _images()
    got = pickscore.preprocess(images)
    assert got.shape == (len(images), 3, 224, 224) and got.dtype == torch.float32
    expected = torch.stack([_pickscore_pixels(im) for im in images])
    # PIL bicubic on uint8, then /255: the processor's float32 arithmetic vs float64 here
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_pickscore_equals_the_published_computation(pickscore, pickscore_dirs):
    images = _images()
    got = pickscore.scores(PROMPTS, images)
    expected = _pickscore_reference(*pickscore_dirs, PROMPTS, images)
    assert got.shape == (len(PROMPTS),) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)  # |score| <= 100
    assert got.std() > 1.0  # the tiny random model still separates the pairs (the test can fail)
    assert pickscore(prompts=PROMPTS, completions=images) == got.tolist()
    halved = PickScoreReward(model=str(pickscore_dirs[0]), processor=str(pickscore_dirs[1]), divisor=26.0,
                             device="cpu")
    torch.testing.assert_close(halved.scores(PROMPTS, images), got / 26.0)


def test_pickscore_pairs_image_i_with_prompt_i_and_batching_changes_nothing(pickscore):
    images = _images()
    full = pickscore.scores(PROMPTS, images)  # batch_size 2: three text and image batches
    singles = torch.cat([pickscore.scores([p], [im]) for p, im in zip(PROMPTS, images)])
    torch.testing.assert_close(full, singles, rtol=1e-5, atol=1e-4)
    order = [3, 0, 4, 1, 2]
    permuted = pickscore.scores([PROMPTS[i] for i in order], [images[i] for i in order])
    torch.testing.assert_close(permuted, full[order], rtol=1e-5, atol=1e-4)
    shifted = pickscore.scores(PROMPTS[1:] + PROMPTS[:1], images)  # wrong pairing -> different scores
    assert (shifted - full).abs().max() > 1e-2
    # tensors in [0, 1] (the policies' output) score like the 8-bit PIL images they round to
    as_tensor = torch.from_numpy(np.array(images[2])).permute(2, 0, 1)[None].float() / 255.0
    torch.testing.assert_close(pickscore.scores(PROMPTS[2:3], as_tensor), full[2:3], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="2 prompts for 5 images"):
        pickscore.scores(PROMPTS[:2], images)


# ------------------------------------------------------------------------------------------ HPSv2
def tiny_hps(root) -> dict[str, str]:
    """``HpsReward`` kwargs (checkpoint folder, model_name = an open_clip config JSON) written under ``root``:
    ViT-H-14's layout (ViT + 77-token text tower over open_clip's 49408-token BPE) shrunk to width 32, and
    its random weights saved as HPSv2 publishes them, ``{"state_dict": ...}`` in ``HPS_v2.1_compressed.pt``."""
    import open_clip

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    config = root / "unialign-test-tiny-hps.json"
    config.write_text(json.dumps({
        "embed_dim": 16,
        "vision_cfg": {"image_size": 224, "layers": 2, "width": 32, "head_width": 16, "patch_size": 32},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}))
    open_clip.add_model_config(config)
    torch.manual_seed(1)
    model = open_clip.create_model("unialign-test-tiny-hps", pretrained=None)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0))  # must NOT enter the HPS score
    folder = root / "checkpoint"
    folder.mkdir()
    torch.save({"state_dict": model.state_dict()}, folder / HPS_FILENAMES["v2.1"])
    return {"checkpoint": str(folder), "model_name": str(config)}


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory):
    """(open_clip config JSON, checkpoint folder) of ``tiny_hps``."""
    kwargs = tiny_hps(tmp_path_factory.mktemp("hps"))
    return Path(kwargs["model_name"]), Path(kwargs["checkpoint"])


def _hps_reference(config, checkpoint_file, prompts, images) -> torch.Tensor:
    """HPSv2's ``img_score.score`` per (image, prompt): open_clip's own eval transform and tokenizer,
    ``model(image, text)`` with output_dict, diag(image_features @ text_features.T)."""
    import open_clip

    model, _, preprocess_val = open_clip.create_model_and_transforms(config.stem, pretrained=None, output_dict=True)
    model.load_state_dict(torch.load(checkpoint_file, weights_only=True)["state_dict"])
    model.eval()
    tokenizer = open_clip.get_tokenizer(config.stem)
    out = []
    with torch.no_grad():
        for prompt, image in zip(prompts, images):
            outputs = model(preprocess_val(image)[None], tokenizer([prompt]))
            logits = outputs["image_features"] @ outputs["text_features"].T
            out.append(torch.diagonal(logits)[0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def hps(hps_files):
    config, folder = hps_files
    return HpsReward(checkpoint=str(folder), model_name=str(config), device="cpu", batch_size=2)


def test_hps_equals_the_published_computation(hps, hps_files):
    config, folder = hps_files
    images = _images()
    got = hps.scores(PROMPTS, images)
    expected = _hps_reference(config, folder / HPS_FILENAMES["v2.1"], PROMPTS, images)
    assert got.shape == (len(PROMPTS),) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.abs().max() <= 1.0 and got.std() > 1e-2  # a cosine, no logit scale; pairs separated
    assert hps(prompts=PROMPTS, completions=images) == got.tolist()


def test_hps_pairs_image_i_with_prompt_i_and_loads_a_file_or_the_registry(hps, hps_files):
    config, folder = hps_files
    images = _images()
    full = hps.scores(PROMPTS, images)
    order = [4, 2, 0, 3, 1]
    torch.testing.assert_close(hps.scores([PROMPTS[i] for i in order], [images[i] for i in order]), full[order],
                               rtol=1e-5, atol=1e-6)
    assert (hps.scores(PROMPTS[::-1], images) - full).abs().max() > 1e-3
    from_file = get_reward("hps", checkpoint=str(folder / HPS_FILENAMES["v2.1"]), model_name=str(config),
                           device="cpu")
    torch.testing.assert_close(from_file.score(PROMPTS, images).float(), full, rtol=1e-5, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="HPS_v2_compressed.pt"):
        HpsReward(checkpoint=str(folder), version="v2.0", model_name=str(config))
    with pytest.raises(ValueError, match="version"):
        HpsReward(checkpoint=str(folder), version="v3", model_name=str(config))


def test_hps_refuses_a_checkpoint_of_another_architecture_or_a_pickle(hps_files, tmp_path):
    config, folder = hps_files
    state = torch.load(folder / HPS_FILENAMES["v2.1"], weights_only=True)["state_dict"]
    del state["text_projection"]
    torch.save({"state_dict": state}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="missing keys.*text_projection"):
        HpsReward(checkpoint=str(tmp_path / "bad.pt"), model_name=str(config))
    torch.save({"state_dict": {}, "args": argparse.Namespace(lr=1e-5)}, tmp_path / "pickled.pt")  # a training ckpt
    with pytest.raises(ValueError, match="not a plain state dict"):
        HpsReward(checkpoint=str(tmp_path / "pickled.pt"), model_name=str(config))


def test_pickscore_through_the_registry(pickscore_dirs):
    model_dir, processor_dir = pickscore_dirs
    reward = get_reward("pickscore", model=str(model_dir), processor=str(processor_dir), device="cpu")
    out = reward.score(PROMPTS[:2], _images(2))
    assert out.shape == (2,) and torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------ offline
@pytest.mark.parametrize("make,name", [
    (lambda: PickScoreReward(device="cpu"), "yuvalkirstain/PickScore_v1"),
    (lambda: HpsReward(device="cpu"), "xswu/HPSv2"),
    (lambda: get_reward("hps", version="v2.0", device="cpu"), "xswu/HPSv2"),
], ids=["pickscore", "hps", "hps-registry"])
def test_hub_ids_fail_fast_offline_with_a_clear_message(make, name, monkeypatch):
    import unialign.hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(unialign.hub, "_hub_cached", lambda name, kind: False)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=f"cannot load the model '{name}': HF_HUB_OFFLINE is set"):
        make()
    assert time.perf_counter() - start < 5.0


def test_pickscore_checks_the_processor_id_before_loading_the_model(pickscore_dirs, monkeypatch):
    import unialign.hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(unialign.hub, "_hub_cached", lambda name, kind: False)
    with pytest.raises(RuntimeError, match="laion/CLIP-ViT-H-14-laion2B-s32B-b79K"):
        PickScoreReward(model=str(pickscore_dirs[0]), device="cpu")
