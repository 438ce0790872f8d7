"""``VisionLanguagePolicy``: images and videos in, text out -- a ``CausalLMPolicy`` whose prompts carry them.

A step is still a sampled token, so everything but the prompt's encoding is the text policy's: the fused
log-prob head (no [B, T, V] logits), the prompt-prefix pass, the reference, the critic head, saving, and every
trainer and algorithm unchanged. What this class adds:

* prompts are conversations whose image blocks hold their images (``unialign.vision.media.multimodal_prompt``,
  TRL's format); each row goes through the processor ALONE, so its image tensors stay its own: the payload keeps
  them per sample (``media``, a list), and a micro-batch of any rows re-collates exactly its rows' patches
  (``families.collate_media``) -- never a slice of a flattened ``pixel_values`` by row count;
* videos (lists of frames, ``unialign.vision.media``) go to the processor's ``videos`` beside the images, for the
  families that take them (``families.VIDEO``); a video row for another family is refused naming the row;
* placeholder and image / video counts are checked per row before any forward, and a prompt longer than
  ``max_prompt_length`` is cut from the left only where no image or video token is cut -- otherwise it is
  refused, naming the row, the limit and the size knobs (transformers' "Image features and image tokens do not match"
  never happens silently);
* positions from the family (3-D M-RoPE for the Qwen-VL line) and the processor's token-aligned outputs
  (``token_type_ids``, ``mm_token_type_ids``) reach every forward, extended over the completion;
* image tokens are never sampled (``suppress_tokens``): a completion holding one would have no features to match.

Sampling uses the dynamic KV cache; the shared prompt prefill of ``generate`` is off (a VLM's positions depend
on its images), the training forward's prompt-prefix pass is on and keyed by the images too.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch

from unialign.dist import unwrap
from unialign.errors import UserError
from unialign.hub import hub_error, require_hub
from unialign.text.head import install_fused_head
from unialign.text.policy import CausalLMPolicy, load_model_options, prepare_model
from unialign.text.prefix import cached_prefix, prefix_sharing_safe
from unialign.types import PreferenceBatch
from unialign.vision import families
from unialign.vision.media import count_blocks, prompt_images, prompt_text, prompt_videos, strip_images
from unialign.weights import check_finite

# processor knobs that bound an image's size (and so its number of image tokens), passed at load time
IMAGE_SIZE_KNOBS = ("max_pixels", "min_pixels", "image_size", "longest_edge")
# the text-tower modules LoRA adapts by default (the vision tower stays frozen, as TRL's VLM examples do)
LORA_TEXT_TARGETS = r"^(?!.*(visual|vision)).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"


class VisionLanguagePolicy(CausalLMPolicy):
    """Policy over token sequences conditioned on images (``AutoModelForImageTextToText`` + ``AutoProcessor``).

    Same keywords as ``CausalLMPolicy`` (the critic: ``value_head=True`` / ``"shared"`` only, a head on the
    VLM's last hidden state, which has seen the images); ``processor`` replaces the tokenizer."""

    def __init__(self, model: torch.nn.Module, processor: Any, **kwargs: Any):
        if kwargs.get("generation_backend", "hf") != "hf":
            raise ValueError("generation_backend: vision-language policies sample with transformers' generate "
                             "('hf'); the vLLM backend is text-only here")
        if kwargs.get("value_head") not in (None, False, True, "shared"):
            raise ValueError("value_head: a vision-language policy's critic is the shared head (True / 'shared'); "
                             "a separate critic backbone would not see the images")
        if kwargs.get("generation_cache", "auto") == "static":
            raise ValueError("generation_cache='static' is for text policies; a VLM samples with the dynamic cache")
        kwargs["generation_cache"] = "dynamic"
        self.processor = processor
        super().__init__(model, processor.tokenizer, **kwargs)
        self.family = families.model_type(self._core())
        self.image_ids = families.image_token_ids(self._core(), processor)

    def sampling_view(self, model: torch.nn.Module) -> VisionLanguagePolicy:
        """``CausalLMPolicy.sampling_view`` with its own processor (tokenizer and image processor) too, recording
        log-probs with a forward."""
        view = super().sampling_view(model)
        # recorded log-probs from a forward: decoding's sit 0.006-0.02 above it at every token on the tiny test VLMs
        # of all four families (a normaliser over other scores than the forward's; not traced further), past the
        # first update's ratio check
        view.logp_from_decoding = False
        view.processor = copy.deepcopy(self.processor)
        view.prompt_encoder.tokenizer = view.processor.tokenizer
        return view

    def _core(self) -> torch.nn.Module:
        model = unwrap(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    @classmethod
    def from_pretrained(cls, name_or_path: str, lora_rank: int = 0, lora_alpha: float | None = None,
                        lora_target_modules: list[str] | str | None = None, torch_dtype: str = "float32",
                        trust_remote_code: bool = False, processor_kwargs: dict[str, Any] | None = None,
                        freeze_vision: bool = False, attn_implementation: str | None = None,
                        gradient_checkpointing: bool = False, **kwargs: Any) -> VisionLanguagePolicy:
        """Load an ``AutoModelForImageTextToText`` and its ``AutoProcessor`` by hub id or folder (safetensors
        only); ``processor_kwargs`` sets the processor's image-size knobs (``max_pixels`` ...); LoRA on the text
        tower's projections by default; ``freeze_vision`` freezes the vision tower. Fails at once offline."""
        from transformers import AutoModelForImageTextToText, AutoProcessor

        require_hub(name_or_path, "model")
        try:
            processor = AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                      **(processor_kwargs or {}))
            model = AutoModelForImageTextToText.from_pretrained(
                name_or_path, use_safetensors=True,
                **load_model_options(name_or_path, torch_dtype, trust_remote_code, attn_implementation))
        except (OSError, ValueError) as err:
            raise hub_error(name_or_path, err) from None
        check_finite(model, name_or_path)
        install_fused_head(model, kwargs.get("chunk_size", 1024))
        if freeze_vision:
            for name, p in model.named_parameters():
                if "visual" in name or "vision" in name:
                    p.requires_grad_(False)
        model = prepare_model(model, lora_rank, lora_alpha, lora_target_modules or LORA_TEXT_TARGETS,
                              gradient_checkpointing)
        return cls(model, processor, **kwargs)

    # ---------------------------------------------------------------- prompts
    def format_prompt(self, prompt: Any) -> str:
        """The prompt as text, image blocks rendered by the processor's chat template (its image placeholders)."""
        if not self.is_templated(prompt):
            return super().format_prompt(prompt)
        template = getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise ValueError("a conversational prompt needs a chat template, and the processor has none: pass "
                             "--chat_template never to use the messages' text raw")
        messages = strip_images(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
        if self.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _encode_prompts(self, prompts: list[Any]) -> dict[str, Any]:
        """Left-padded ``input_ids`` / ``attention_mask`` [B, W], the token-aligned extras [B, W], ``media``
        (list[B] of the row's image tensors) and ``media_key`` [B] (a digest of them, for the prefix pass)."""
        seen: dict[int, dict[str, torch.Tensor]] = {}  # a GRPO group repeats one prompt object: process it once
        rows = [seen[id(p)] if id(p) in seen else seen.setdefault(id(p), self._encode_row(i, p))
                for i, p in enumerate(prompts)]
        W = max(r["input_ids"].shape[1] for r in rows)
        out: dict[str, Any] = {}
        token_keys = [k for k in ("input_ids", "attention_mask", *families.TOKEN_KEYS) if k in rows[0]]
        for key in token_keys:
            fill = self.tokenizer.pad_token_id if key == "input_ids" else 0
            out[key] = torch.stack([torch.nn.functional.pad(r[key][0], (W - r[key].shape[1], 0), value=fill)
                                    for r in rows]).to(self.device)
        media = {id(r): {k: v for k, v in r.items() if k not in token_keys} for r in rows}  # one per distinct row
        keys = {i: _digest(m) for i, m in media.items()}
        out["media"] = [media[id(r)] for r in rows]
        out["media_key"] = torch.tensor([keys[id(r)] for r in rows], dtype=torch.long, device=self.device)
        return out

    def _encode_row(self, i: int, prompt: Any) -> dict[str, torch.Tensor]:
        media = {"image": prompt_images(prompt), "video": prompt_videos(prompt)}
        for kind, items in media.items():
            blocks = count_blocks(prompt, kind)
            if blocks != len(items):
                raise UserError(f"prompt row {i}: {blocks} {kind} block(s) but {len(items)} {kind}(s) attached; "
                                "build rows with unialign.vision.media.vision_rows (image / images / video / videos "
                                "columns)")
        images, videos = media["image"], media["video"]
        if videos and self.family not in families.VIDEO:
            raise UserError(f"prompt row {i}: holds {len(videos)} video(s), and a {self.family or 'this'} model takes "
                            f"none (video: {', '.join(families.VIDEO)}); give frames as images instead")
        text = self.format_prompt(prompt)
        extra = {"videos": videos} if videos else {}
        enc = self.processor(text=[text], images=[images] if images else None, return_tensors="pt",
                             add_special_tokens=not self.is_templated(prompt), **extra)
        enc = {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}
        enc.setdefault("mm_token_type_ids", None)
        enc = {k: v for k, v in enc.items() if v is not None}
        L, limit = enc["input_ids"].shape[1], self.max_prompt_length
        if limit is not None and L > limit:
            cut = enc["input_ids"][0, : L - limit]
            n_image = int(torch.isin(enc["input_ids"], torch.tensor(self.image_ids)).sum())
            if bool(torch.isin(cut, torch.tensor(self.image_ids)).any()):
                what = "image / video" if videos else "image"
                raise UserError(f"prompt row {i}: {L} tokens ({n_image} of them {what} tokens) > max_prompt_length="
                                f"{limit}, and cutting it would cut {what} tokens (their features would no longer "
                                "match): raise --max_prompt_length or lower the image size (--max_pixels)"
                                + (" or the frames (--max_frames)" if videos else ""))
            for key in ("input_ids", "attention_mask", *families.TOKEN_KEYS):
                if key in enc:
                    enc[key] = enc[key][:, L - limit:]
        return enc

    def count_prompt_tokens(self, prompts: list[Any], limit: int | None = None) -> list[int]:
        """Prompt lengths in tokens with each image's tokens expanded as the processor expands them (what
        ``--max_prompt_length`` bounds; ``unialign.text.data.prompt_token_counter`` asks this)."""
        from unialign.text.data import SPECIAL_SLACK, AtLeast, max_token_bytes

        per = max_token_bytes(self.tokenizer)
        keep, self.max_prompt_length = self.max_prompt_length, None
        out: list[int] = []
        try:
            for i, p in enumerate(prompts):
                size = len(prompt_text(p).encode("utf-8"))  # the template only adds to it
                if limit is not None and size > (limit + SPECIAL_SLACK) * per:  # too long without tokenizing it
                    out.append(AtLeast(size // per))
                else:
                    out.append(int(self._encode_row(i, p)["input_ids"].shape[1]))
            return out
        finally:
            self.max_prompt_length = keep

    def _model_inputs(self, ids: torch.Tensor, mask: torch.Tensor, payload: dict, rows: torch.Tensor | None = None,
                      width: int | None = None) -> dict[str, Any]:
        """Forward kwargs for ``ids`` / ``mask`` [B, L] whose first ``width`` columns are the prompt (the rest
        completion): the rows' collated media, token-aligned extras zero-extended, and positions."""
        media = payload["media"] if rows is None else [payload["media"][r] for r in rows.tolist()]
        kw: dict[str, Any] = families.collate_media(media, self.family, ids.device)
        for key in families.TOKEN_KEYS:
            if key in payload:
                t = payload[key] if rows is None else payload[key][rows]
                kw[key] = torch.nn.functional.pad(t[:, :width] if width else t, (0, ids.shape[1] - (width or t.shape[1])))
        kw["position_ids"] = families.positions(unwrap(self.model), ids, mask, kw)
        return kw

    # ---------------------------------------------------------------- sampling (the text policy's HFRollout)
    def _generate_inputs(self, enc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``generate``'s inputs: ids, mask, the rows' collated images and token types (positions are
        ``generate``'s own: it adds the rope deltas of the new tokens), image tokens suppressed; the payload
        keeps ``media`` (per row), ``media_key`` and the token-aligned extras."""
        kw = self._model_inputs(enc["input_ids"], enc["attention_mask"], enc)
        kw.pop("position_ids")
        inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], **kw,
                  "suppress_tokens": self.image_ids or None}
        return inputs, {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}

    def _prompt_cache(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """No shared prompt prefill in ``generate``: a VLM's prefill holds its images and rope deltas (the
        training forward's prefix pass is ``_vision_prefix``)."""
        return None

    # ---------------------------------------------------------------- log-probs
    def _forward(self, model: torch.nn.Module, payload: dict, with_entropy: bool, with_values: bool = False):
        """Per-token (logp, entropy, values) of the completion, [B, T] each: ``CausalLMPolicy._forward`` with
        the rows' images, their positions and token types."""
        index = _right_align_index(payload["prompt_mask"])
        payload = {**payload, **{k: payload[k].gather(1, index) for k in ("prompt_ids", "prompt_mask",
                                                                          *families.TOKEN_KEYS) if k in payload}}
        prompt_ids, prompt_mask, completion = payload["prompt_ids"], payload["prompt_mask"], payload["completion_ids"]
        W, T = prompt_ids.shape[1], completion.shape[1]
        input_ids = torch.cat([prompt_ids, completion], dim=1)
        attention_mask = torch.cat([prompt_mask, payload["completion_mask"]], dim=1)
        kw = self._model_inputs(input_ids, attention_mask, payload, width=W)
        targets = torch.cat([completion, completion[:, :1]], dim=1)
        head = unwrap(model).get_output_embeddings()
        if with_values and self.value_head is None:
            raise ValueError("this policy has no critic: build it with value_head=True (PPO)")
        prefix = self._vision_prefix(model, payload, input_ids, attention_mask, kw, W, T) \
            if self.share_prompt_prefix else None
        with head.targets(targets, self.temperature):
            if prefix is None:
                out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=T + 1,
                            output_hidden_states=with_values, use_cache=False, **kw)
            else:
                tail = {k: v[..., -T - 1:] for k, v in kw.items() if k in ("position_ids", *families.TOKEN_KEYS)}
                out = model(input_ids=input_ids[:, -T - 1:], attention_mask=attention_mask, use_cache=True,
                            output_hidden_states=with_values, **tail, **prefix)
        stats = out.logits[:, :-1].float()
        values = None
        if with_values:
            values = self.value_head(out.hidden_states[-1][:, -T - 1:-1]).squeeze(-1).float()
        return stats[..., 0], stats[..., 1], values

    def _vision_prefix(self, model, payload, input_ids, attention_mask, kw, W: int, T: int):
        """The prompt-prefix pass of ``CausalLMPolicy._prompt_cache`` for image prompts: distinct prompts (by
        ids, mask AND images) run once, their cache gathered to the samples; None when it cannot help or is not
        safe (no repeats, ``prefix_sharing_safe``, an image token in the per-sample tail)."""
        if W < 2 or not prefix_sharing_safe(model):
            return None
        tail = input_ids[:, -T - 1:]
        if self.image_ids and bool(torch.isin(tail, torch.tensor(self.image_ids, device=tail.device)).any()):
            return None
        rows = torch.cat([payload["prompt_ids"], payload["prompt_mask"], payload["media_key"][:, None]], dim=1)
        distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
        if distinct.shape[0] == rows.shape[0]:
            return None
        first = torch.full((distinct.shape[0],), rows.shape[0], dtype=torch.long, device=rows.device)
        first = first.scatter_reduce(0, inverse, torch.arange(rows.shape[0], device=rows.device), "amin")
        ids, mask = input_ids[first, : W - 1], attention_mask[first, : W - 1]
        if bool((mask.sum(-1) < 1).any()):
            return None
        media = families.collate_media([payload["media"][r] for r in first.tolist()], self.family, ids.device)
        head_kw = {k: v[first][..., : W - 1] if k != "position_ids" or v.dim() == 2 else v[:, first, : W - 1]
                   for k, v in kw.items() if k in ("position_ids", *families.TOKEN_KEYS)}
        return cached_prefix(model, inverse, input_ids=ids, attention_mask=mask, **media, **head_kw)

    # ---------------------------------------------------------------- pairs
    def preference_batch(self, rows: list[dict[str, Any]], max_length: int | None = None) -> PreferenceBatch:
        """``CausalLMPolicy.preference_batch`` with each side carrying the prompt's images (RLAIF-V's format:
        image + prompt + chosen / rejected)."""
        batch = super().preference_batch(rows, max_length)
        enc = self._encode_prompts([r["prompt"] for r in rows])
        extras = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        for side in (batch.chosen, batch.rejected):
            side.update(extras)
        return batch


    # ---------------------------------------------------------------- io
    def save(self, path: str) -> None:
        """The model (or adapters) and the whole processor (tokenizer, image processor, chat template),
        loadable with ``AutoModelForImageTextToText`` / ``AutoProcessor``."""
        from unialign.dist import is_main_rank

        super().save(path)
        if is_main_rank():
            self.processor.save_pretrained(path)


def _digest(media: dict[str, torch.Tensor]) -> int:
    """A 63-bit digest of a row's image tensors (0 for a text-only row): prompts with equal tokens but other
    images must not share a prefix cache."""
    if not media:
        return 0
    h = hashlib.blake2b(digest_size=8)
    for key in sorted(media):
        t = media[key].detach().cpu().contiguous()
        h.update(key.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def _right_align_index(mask_B_W: torch.Tensor) -> torch.Tensor:
    """The gather index rolling each row right so its last attended token sits in the last column (the same
    roll as ``unialign.text.policy._right_align``, applied to every token-aligned tensor)."""
    W = mask_B_W.shape[1]
    last = (mask_B_W * torch.arange(1, W + 1, device=mask_B_W.device)).argmax(-1)
    shift = (W - 1 - last).unsqueeze(-1)
    return (torch.arange(W, device=mask_B_W.device) - shift) % W
