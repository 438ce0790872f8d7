"""Tiny random-weight vision-language models of three real families, built in code (no download), with
their processors: the Qwen2-VL line (Qwen2-VL and Qwen2.5-VL: flattened patches + ``image_grid_thw``, M-RoPE, ``mm_token_type_ids``;
Qwen2.5-VL's windowed vision attention),
Idefics3 / SmolVLM (``pixel_values`` [B, N, C, H, W] + ``pixel_attention_mask``, 1-D positions) and Gemma 3
(``token_type_ids``: bidirectional attention over image tokens). TRL's tests use the same kind of models
(``trl-internal-testing/tiny-*``); these are written here so the suite stays offline.

``build(family, seed=0) -> (model, processor)``; ``random_image(rng, size)`` gives PIL test images.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from PIL import Image

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "idefics3", "gemma3")
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]


def _tokenizer(specials: list[str], eos: str, template: str, extra: dict | None = None):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", *specials, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<unk>", *specials])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token=eos, unk_token="<unk>",
                                 clean_up_tokenization_spaces=False, extra_special_tokens=extra or {})
    hf.chat_template = template
    return hf


def _template(image: str, end: str, video: str = "") -> str:
    """A ChatML-like template rendering typed content blocks: an image block is ``image``'s text, a video block
    ``video``'s (Qwen2-VL's)."""
    return ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' }}"
            "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
            "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}{{- '" + image + "' }}"
            "{%- elif part['type'] == 'video' %}{{- '" + video + "' }}"
            "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
            "{{- '" + end + "\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
            "{%- endif %}")


def _text(tok, **kw) -> dict:
    base = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    return {**base, **kw}


def build_qwen2_vl(seed: int = 0):
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    template = _template("<|vision_start|><|image_pad|><|vision_end|>", "<|im_end|>",
                         "<|vision_start|><|video_pad|><|vision_end|>")
    tok = _tokenizer(specials, "<|im_end|>", template)
    knobs = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    proc = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=16 * 16, max_pixels=64 * 64, **knobs),
                            tokenizer=tok, chat_template=template,
                            video_processor=Qwen2VLVideoProcessor(size={"shortest_edge": 16 * 16,
                                                                        "longest_edge": 64 * 64}, **knobs))
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2VLConfig(
        text_config=_text(tok, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3, mlp_ratio=2),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(cfg).eval(), proc


def build_qwen2_5_vl(seed: int = 0):
    """TRL's tiny Qwen2.5-VL recipe's shape (windowed vision blocks, one full-attention block, ``out_hidden_size``),
    on the Qwen2-VL tokenizer and image processor (the two share them)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    base, proc = build_qwen2_vl(seed)
    tok = proc.tokenizer
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=_text(tok, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=32,
                           window_size=8, fullatt_block_indexes=[1]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=True)
    processor = Qwen2_5_VLProcessor(image_processor=proc.image_processor, tokenizer=tok,
                                    video_processor=proc.video_processor, chat_template=proc.chat_template)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg).eval(), processor


def build_idefics3(seed: int = 0):
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    specials = ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>",
                *[f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]]
    template = _template("<image>", "<end_of_utterance>")
    tok = _tokenizer(specials, "<end_of_utterance>", template)
    image_size, patch, scale = 32, 4, 2
    seq_len = (image_size // patch) ** 2 // scale ** 2
    ip = Idefics3ImageProcessor(do_image_splitting=False, size={"longest_edge": image_size},
                                max_image_size={"longest_edge": image_size}, do_resize=True)
    proc = Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=seq_len, chat_template=template)
    cfg = Idefics3Config(
        text_config=_text(tok, model_type="llama"),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=image_size, patch_size=patch),
        scale_factor=scale, image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return Idefics3ForConditionalGeneration(cfg).eval(), proc


def build_gemma3(seed: int = 0):
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    specials = ["<|im_start|>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    template = _template("<start_of_image>", "<end_of_turn>")
    tok = _tokenizer(specials, "<end_of_turn>", template, extra={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    image_size, patch, mm_tokens = 32, 4, 4
    ip = Gemma3ImageProcessor(size={"height": image_size, "width": image_size}, do_pan_and_scan=False)
    proc = Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=template, image_seq_length=mm_tokens)
    ids = tok.convert_tokens_to_ids
    cfg = Gemma3Config(
        text_config=_text(tok, model_type="gemma3_text", head_dim=8, sliding_window=64,
                          layer_types=["full_attention", "full_attention"]),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, image_size=image_size, patch_size=patch),
        mm_tokens_per_image=mm_tokens, boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"), tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(cfg).eval(), proc


def build(family: str, seed: int = 0):
    return {"qwen2_vl": build_qwen2_vl, "qwen2_5_vl": build_qwen2_5_vl, "idefics3": build_idefics3,
            "gemma3": build_gemma3}[family](seed)


def random_image(rng: random.Random, size: tuple[int, int] | None = None) -> Image.Image:
    w, h = size or (rng.choice([32, 40, 48]), rng.choice([32, 40, 48]))
    arr = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 255, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(arr)
