"""What differs between vision-language families, as data: how each processor output batches, and how positions
are computed. ``VisionLanguagePolicy`` reads this table; a new family is a row, not a branch.

A processor run on ONE row gives ``input_ids`` / ``attention_mask`` [1, L] plus extra outputs of three kinds:

* token-aligned ([1, L], padded like the ids, zeros over the completion): ``TOKEN_KEYS``
  (Qwen2-VL's ``mm_token_type_ids``, Gemma 3's ``token_type_ids``: its bidirectional attention over image tokens);
* per image, concatenated over the batch's images (default): Qwen2-VL's flattened patches ``pixel_values``
  [patches, C*p*p] with ``image_grid_thw`` [images, 3], Gemma 3's ``pixel_values`` [images, C, H, W];
* per row (``ROW_BATCHED``: [1, N, ...]; padded to the batch's largest N and image size with zeros, which these
  models treat as padding images): Idefics2 / Idefics3 / SmolVLM's ``pixel_values`` and ``pixel_attention_mask``.

Video: the ``VIDEO`` families (the Qwen-VL line) take clips beside images; their per-video outputs
(``pixel_values_videos`` [patches, C*t*p*p], ``video_grid_thw`` [videos, 3]) concatenate like the per-image ones.

Positions: ``"mrope"`` families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) have 3-D rotary positions over (time, height,
width) from the model's own ``get_rope_index``; all others use 1-D positions that follow the attention mask.
"""

from __future__ import annotations

from typing import Any

import torch

TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")
ROW_BATCHED = {  # model_type -> the processor outputs that are [1, N_images, ...] per row
    "idefics2": ("pixel_values", "pixel_attention_mask"),
    "idefics3": ("pixel_values", "pixel_attention_mask"),
    "smolvlm": ("pixel_values", "pixel_attention_mask"),
}
MROPE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# the families whose processors take ``videos`` (a clip of frames -> ``pixel_values_videos`` + ``video_grid_thw``,
# temporal patches of the 3-D rotary positions); a video row for any other family is refused naming the row
VIDEO = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def model_type(model: torch.nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", "") or ""


def collate_media(media: list[dict[str, torch.Tensor]], family: str, device: torch.device) -> dict[str, Any]:
    """Per-row processor outputs (``media``, one dict per row; {} for a text-only row) -> the batch's model
    keyword arguments (module docstring). Rows keep their order; a key no row has is absent."""
    keys = list(dict.fromkeys(k for m in media for k in m))
    batched = ROW_BATCHED.get(family, ())
    out: dict[str, Any] = {}
    for key in keys:
        have = [m[key] for m in media if key in m]
        if key in batched:
            shape = [max(t.shape[d] for t in have) for d in range(1, have[0].dim())]
            rows = []
            for m in media:
                padded = have[0].new_zeros((1, *shape))
                if key in m:
                    t = m[key]
                    padded[(slice(0, 1), *[slice(0, s) for s in t.shape[1:]])] = t
                rows.append(padded)
            out[key] = torch.cat(rows).to(device)
        else:
            out[key] = torch.cat(have).to(device)
    return out


def positions(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              inputs: dict[str, Any]) -> torch.Tensor:
    """Position ids of a left-padded batch: [3, B, L] from the model's ``get_rope_index`` for M-RoPE families,
    else [B, L] following the attention mask (what ``generate`` uses)."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    if model_type(core) in MROPE:
        inner = core.model
        # Qwen2.5-VL's video positions advance with the clip's seconds per temporal patch (its processor's
        # second_per_grid_ts, one per video); Qwen2-VL's processor gives none
        timing = {"second_per_grid_ts": inputs["second_per_grid_ts"]} if "second_per_grid_ts" in inputs else {}
        found = inner.get_rope_index(input_ids, mm_token_type_ids=inputs.get("mm_token_type_ids"),
                                     image_grid_thw=inputs.get("image_grid_thw"),
                                     video_grid_thw=inputs.get("video_grid_thw"), attention_mask=attention_mask,
                                     **timing)
        return found[0]
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def image_token_ids(model: torch.nn.Module, processor: Any) -> list[int]:
    """The ids that stand for image (and video) features: never to be generated, never to be cut."""
    cfg = model.config
    ids = {getattr(cfg, name, None) for name in ("image_token_id", "image_token_index", "video_token_id")}
    token = getattr(processor, "image_token", None)
    if isinstance(token, str):
        tid = processor.tokenizer.convert_tokens_to_ids(token)
        if tid is not None and tid != processor.tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)
