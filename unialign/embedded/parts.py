"""What the scripts need to run on the demo worlds: the image RL parts (policy, rewards, prompts, gold
score, verifier) of the shapes world, and its AI-feedback preference pairs for Diffusion-DPO."""

from __future__ import annotations

import importlib
from typing import Any

from unialign.embedded import IMAGE_SD3_NAME, VIDEO_NAME, check_model_kind
from unialign.embedded import shapes_world as world
from unialign.embedded.shape_verifier import PARTS, parse_shape_prompt, verify
from unialign.errors import UserError
from unialign.image.data import normalize_pickapic, synthetic_pairs
from unialign.image.families import FAMILIES
from unialign.recipes.image import (
    EVAL_ON_TRAIN,
    check_prompts,
    check_reward_rows,
    check_sampling_knobs,
    load_prompt_rows,
    policy_kwargs,
    split_prompt_rows,
)
from unialign.recipes.text import reward_names
from unialign.rewards import CombinedReward, get_reward

NAME = "embedded"  # the word the scripts resolve to these worlds (model, data set, prompt set)
NAME_SD3 = IMAGE_SD3_NAME  # the shapes world's flow-matching (SD3-architecture) model
NAME_WAN = VIDEO_NAME  # the motion world's text-to-video (Wan-architecture) model
# the embedded denoisers: their family (unialign.image.families) and their loader (a module of unialign.embedded
# and its function): the shapes world's image models and the motion world's video model
EMBEDDED_MODELS = {NAME: (FAMILIES["sdxl"], "shapes_world:load_embedded"),
                   NAME_SD3: (FAMILIES["sd3"], "shapes_world:load_embedded_sd3"),
                   NAME_WAN: (FAMILIES["wan"], "motion_world:load_embedded_wan")}
IMAGE_MODELS = tuple(EMBEDDED_MODELS)


def image_rl_parts(cfg) -> dict[str, Any]:
    """What ``unialign.recipes.image.run_image_rl`` needs for the shapes world's model (``cfg.model_name_or_path``:
    "embedded", the SDXL-architecture DDIM model, or "embedded-sd3", the SD3-architecture flow-matching one): the policy (``cfg``'s
    sampling knobs), the rewards (the shipped tiny CLIP / head for the model-based ones), the train and
    held-out prompts (``cfg.prompt_set``: "embedded", the world's own split, or a file split by
    ``unialign.recipes.image.split_prompt_rows``) and their ``eval_source``, the gold score and, when every held-out
    prompt is one of this world's, the shape verifier for prompt fidelity. Prompts are checked before any
    model loads when the shape verifier is a reward."""
    names, weights = reward_names(cfg.reward_funcs, cfg.reward_weights)
    family = embedded_family(cfg.model_name_or_path, cfg.model_family)
    check_sampling_knobs(cfg, family)  # bad input named before any model loads
    own = tuple([{"prompt": p} for p in world.prompts(s)] for s in ("train", "test"))
    train, held_out, eval_source = split_prompt_rows(cfg, {NAME: own})
    if any(n.startswith("shape_verifier") or n == "geneval" for n in names):  # both read this world's prompts,
        # trained or evaluated: every row of each file, named by its place in the file
        errors = getattr(cfg, "encoding_errors", "strict")
        for field in ("prompt_set", "eval_prompt_set"):
            name = getattr(cfg, field, None)
            if name not in (None, NAME, EVAL_ON_TRAIN):
                try:
                    check_prompts([r["prompt"] for r in load_prompt_rows(name, errors, field)], parse_shape_prompt,
                                  field)
                except ValueError as err:
                    raise UserError(f"{err}. On the embedded image models, {', '.join(names)} can read only the "
                                    f"shapes world's prompts ('a red circle on a blue background': background, colour, "
                                    f"shape; the geneval reward's backend there is its pixel detector, 'shapes'); "
                                    f"GenEval's own prompts need GenEval's detector on a real model (--preset "
                                    f"sd3.5-medium-geneval)") from None
    check_reward_rows(names, train + held_out, geneval_columns=False)  # the pixel detector reads the prompts
    try:
        check_prompts([r["prompt"] for r in held_out], parse_shape_prompt, "prompt_set")
        verifier = fidelity_checks
    except ValueError:
        verifier = None  # prompts from elsewhere: no fidelity to read
    reward = CombinedReward([get_reward(n, **world.reward_kwargs(n)) for n in names], weights,
                            timeout_s=getattr(cfg, "reward_timeout", None))
    return dict(policy=embedded_policy(cfg.model_name_or_path, **policy_kwargs(cfg, family)), reward=reward,
                train_prompts=train, eval_prompts=held_out, gold=world.gold_score, verifier=verifier,
                eval_source=eval_source)


def video_rl_parts(cfg) -> dict[str, Any]:
    """``image_rl_parts`` for the motion world's video model ("embedded-wan"): the policy, the rewards (an image
    reward scored on every frame, ``build_rewards``), the train and held-out prompts (``cfg.prompt_set``
    "embedded": the world's own split; else a prompt file split as ``split_prompt_rows`` does) and, when every
    held-out prompt is one of this world's, its clip verifier for prompt fidelity (no gold score)."""
    from unialign.embedded import motion_world
    from unialign.recipes.image import build_rewards

    names, weights = reward_names(cfg.reward_funcs, cfg.reward_weights)
    check_sampling_knobs(cfg, "wan")  # bad input named before any model loads
    own = tuple([{"prompt": p} for p in motion_world.prompts(s)] for s in ("train", "test"))
    train, held_out, eval_source = split_prompt_rows(cfg, {NAME: own})
    if any(n.startswith("motion_verifier") for n in names):
        check_prompts([r["prompt"] for r in train + held_out], motion_world.parse_motion_prompt, "prompt_set")
    check_reward_rows(names, train + held_out, geneval_columns=False)
    try:
        check_prompts([r["prompt"] for r in held_out], motion_world.parse_motion_prompt, "prompt_set")
        verifier = motion_world.fidelity_checks
    except ValueError:
        verifier = None  # prompts from elsewhere: no fidelity to read
    reward = build_rewards(cfg, names, weights, "video", world.reward_kwargs)
    return dict(policy=embedded_policy(cfg.model_name_or_path, **policy_kwargs(cfg, "wan")), reward=reward,
                train_prompts=train, eval_prompts=held_out, verifier=verifier, eval_source=eval_source)


# the parts of each embedded model's world, as run_online_image takes them
WORLD_PARTS = {NAME: image_rl_parts, NAME_SD3: image_rl_parts, NAME_WAN: video_rl_parts}


def fidelity_checks(prompts: list[str], images: Any, **columns: Any) -> dict[str, Any]:
    """The shape verifier as the held-out evaluation reads a verifier (``unialign.image.evaluate.sample_scores``):
    ``all`` (all three right, the fidelity) and the per-image rates it logs as ``fidelity/<name>``: each part
    (background, colour, shape) and the partial credit; beside them the second, independent reading
    (``unialign.embedded.shape_reader``, a classifier trained on the world's renders that no reward reads):
    ``reader`` (all three read with confidence) and ``reader_<part>``."""
    from unialign.embedded.shape_reader import shipped_reader

    checks = verify(prompts, images, **columns)
    reading = shipped_reader().read(prompts, images)
    return {**{k: checks[k] for k in (*PARTS, "all", "credit")}, "reader": reading["all"],
            **{f"reader_{part}": reading[part] for part in ("background", "colour", "shape")}}


def embedded_family(name: str, requested: str = "auto") -> str:
    """The pipeline family (``EMBEDDED_MODELS``) of the embedded image model ``name``; a ``model_family`` that
    says otherwise is refused (ValueError naming the field) rather than ignored."""
    if name not in IMAGE_MODELS:
        raise ValueError(f"model_name_or_path: {name!r} is not one of the embedded image models {IMAGE_MODELS}")
    family = EMBEDDED_MODELS[name][0].name
    if requested not in ("auto", family):
        raise ValueError(f"model_family: {requested!r}, but the embedded model {name!r} is {family} (leave it auto)")
    return family


def embedded_policy(name: str, **kwargs: Any):
    """The embedded model ``name`` ("embedded": SDXL-architecture ``DiffusionPolicy``; "embedded-sd3": the
    SD3-architecture ``FlowMatchingPolicy``; "embedded-wan": the Wan-architecture text-to-video ``FlowPolicyBase``)
    with ``kwargs`` over its sampling defaults."""
    if name not in IMAGE_MODELS:
        raise ValueError(f"model_name_or_path: {name!r} is not one of the embedded image models {IMAGE_MODELS}")
    module, _, loader = EMBEDDED_MODELS[name][1].partition(":")
    return getattr(importlib.import_module(f"unialign.embedded.{module}"), loader)(**kwargs)


def image_pairs(policy, cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int, dict[str, Any]]:
    """AI feedback on the shapes world, as ``unialign.image.data.load_pickapic`` returns it:
    ``cfg.pairs_per_prompt`` training pairs (and ``cfg.eval_pairs_per_prompt`` held-out pairs, other seeds)
    of two samples of each of the first ``cfg.num_prompts`` training captions, the higher gold score chosen,
    gaps below ``cfg.min_gap`` ties (dropped; held-out ties before the ``cfg.num_eval`` cap)."""
    captions = world.prompts("train")[:cfg.num_prompts]
    train_rows = synthetic_pairs(policy, captions, world.gold_score, cfg.pairs_per_prompt, cfg.seed + 1, cfg.min_gap)
    eval_rows = synthetic_pairs(policy, captions, world.gold_score, cfg.eval_pairs_per_prompt, cfg.seed + 2,
                                cfg.min_gap)
    eval_rows = [r for r in eval_rows if r["label_0"] != 0.5][:cfg.num_eval]
    (train, ties), (held_out, _) = normalize_pickapic(train_rows, "train"), normalize_pickapic(eval_rows, "eval")
    return train, held_out, ties, {"eval_source": "embedded: held-out draws of the training captions"}


def image_pair_parts(cfg: Any) -> dict[str, Any]:
    """What ``scripts/dpo_sdxl.py`` trains on, in this order: ``policy`` (an embedded model by name, else a hub /
    local denoiser), ``train`` / ``held_out`` pairs (the user's Pick-a-Pic-schema data, read and checked before the
    model loads, or else AI feedback on the shapes world: ``image_pairs``), ``ties`` dropped, ``data_info``,
    ``images`` (the held-out pictures before and after: the user's first distinct held-out captions, at most 32,
    for comparison.png; or the world's test prompts with the gold score and prompt fidelity), ``own_data``."""
    from unialign.image.data import load_pickapic
    from unialign.image.evaluate import HeldOutImages
    from unialign.image.grid import first_of_each_prompt
    from unialign.recipes.image import family_of, load_denoiser

    check_model_kind(cfg.model_name_or_path, ("image",))
    embedded, own_data = cfg.model_name_or_path in IMAGE_MODELS, cfg.dataset_name != NAME
    family = (embedded_family(cfg.model_name_or_path, cfg.model_family) if embedded  # a conflicting one is refused
              else family_of(cfg.model_name_or_path, cfg.model_family))
    if FAMILIES[family].output_kind[0] != "image":
        raise UserError(f"--model_name_or_path {cfg.model_name_or_path!r} makes {FAMILIES[family].output_kind[0]}s; "
                        "Diffusion-DPO pairs are images (train a video model with scripts/grpo_video.py)")
    if not own_data and not embedded:
        raise UserError("--dataset_name embedded: pairs of the embedded model's own samples ranked by its world's "
                        "gold score; with another --model_name_or_path give a Pick-a-Pic-schema dataset")
    data = load_pickapic(cfg) if own_data else None  # read and checked before the model loads
    opts = dict(lora_rank=cfg.lora_rank, caption_dropout=cfg.caption_dropout, seed=cfg.seed,
                gradient_checkpointing=cfg.gradient_checkpointing)
    if embedded:
        policy = embedded_policy(cfg.model_name_or_path, **opts)
    else:
        policy = load_denoiser(cfg.model_name_or_path, cfg.model_family, cfg.torch_dtype, cfg.vae_name_or_path, **opts)
    train, held_out, ties, data_info = data or image_pairs(policy, cfg)
    data_info.pop("row_ids", None)  # every held-out row's index: reproducible from eval_split_seed, not printed
    # fixed held-out prompts and seed, the same draws before and after
    if own_data:
        shown = first_of_each_prompt([r["prompt"] for r in held_out], min(cfg.num_eval_images, 32))
        images = HeldOutImages(policy, [held_out[i]["prompt"] for i in shown], 1234, batch_size=8)
    else:
        test = world.prompts("test")
        images = HeldOutImages(policy, [test[i % len(test)] for i in range(cfg.num_eval_images)], 1234,
                               gold=world.gold_score, verifier=fidelity_checks)
    return dict(policy=policy, train=train, held_out=held_out, ties=ties, data_info=data_info, images=images,
                own_data=own_data)


def run_online_image(cfg: Any) -> dict[str, Any]:
    """The run of ``scripts/grpo_image.py`` / ``ddpo_aesthetic.py`` / ``grpo_video.py``: the rewards checked against
    what the model samples (images, or clips: ``sample_kind``) before any model loads, then ``run_image_rl`` on the
    embedded model's world parts (``WORLD_PARTS``), else on a hub / local model's
    (``unialign.recipes.image.hub_parts``). Returns the summary."""
    from unialign.recipes.image import hub_parts, model_family, run_image_rl, sample_kind
    from unialign.recipes.text import check_rewards

    check_model_kind(cfg.model_name_or_path, ("image",))  # a text model, a misspelt name: one line, now
    family = (embedded_family(cfg.model_name_or_path, cfg.model_family) if cfg.model_name_or_path in IMAGE_MODELS
              else model_family(cfg))
    check_rewards(cfg.reward_funcs, cfg.reward_weights, modality=sample_kind(cfg, family))
    parts = WORLD_PARTS[cfg.model_name_or_path](cfg) if cfg.model_name_or_path in IMAGE_MODELS else hub_parts(cfg)
    return run_image_rl(cfg, **parts)
