"""What the online image scripts share (``scripts/ddpo_aesthetic.py``, ``scripts/grpo_image.py``): their
config fields, the hub-model route from a config to a policy, rewards and prompts, and the run itself --
held-out evaluation before / during / after training (reward, prompt fidelity, gold score), grids,
summary, weights. The scripts keep only their defaults and presets; an offline demo world builds its own
parts (the same dict ``hub_parts`` returns).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unialign.config import DTYPES, arg, default
from unialign.data import ENCODING_ERRORS
from unialign.image.evaluate import HeldOutImages
from unialign.image.families import (
    FAMILIES,
    FAMILY_CHOICES,
    Family,
    SamplerKnobs,
    family_names,
    get_family,
    resolve,
)
from unialign.images import ImageDataArgs
from unialign.recipes.args import RunArgs
from unialign.recipes.outputs import finish_image_run
from unialign.recipes.text import reward_names
from unialign.rewards import CombinedReward, get_reward
from unialign.trainers import OnlineConfig, OnlineTrainer
from unialign.trainers.outputs import step_ratio_summary

# ddpo-pytorch's "simple animals" prompt list (config/base.py -> assets/simple_animals.txt, abridged)
ANIMALS = ["cat", "dog", "horse", "monkey", "rabbit", "zebra", "spider", "bird", "sheep", "deer", "cow", "goat",
           "lion", "tiger", "bear", "raccoon", "fox", "wolf", "lizard", "beetle", "ant", "butterfly", "fish",
           "shark", "whale", "dolphin", "squirrel", "mouse", "rat", "snake", "turtle", "frog", "chicken", "duck",
           "goose", "bee", "pig", "turkey", "fly", "llama", "camel", "bat", "gorilla", "hedgehog", "kangaroo"]


@dataclass
class PickapicDataArgs(ImageDataArgs):
    """Data fields of a Pick-a-Pic-schema preference dataset and its held-out split: what ``load_pickapic`` reads
    (``scripts/dpo_sdxl.py`` mixes them into its config)."""

    dataset_name: str = arg("", "Pick-a-Pic-schema Hub id, .jsonl/.json/.parquet file or folder (images as bytes or "
                            "paths)", group="data")
    dataset_config: str | None = arg(None, "Hub dataset configuration", group="data")
    train_split: str = arg("train", "training split of a folder or Hub dataset", group="data")
    eval_split: str | None = arg(None, "held-out split (default: 'test', else 'validation' of a folder; a single file "
                                 "holds out --eval_fraction)", group="data")
    eval_dataset_name: str | None = arg(None, "a separate held-out dataset (file, folder or Hub id)", group="data")
    eval_fraction: float = arg(0.1, "share of the rows held out when the data has no held-out split (fixed seed 0)",
                               group="data", gt=0.0, lt=1.0)
    encoding_errors: str = arg("strict", "dataset text that is not valid UTF-8: 'strict' (refuse it, naming "
                               "file:line) or 'replace' (read each bad byte as U+FFFD)", group="data",
                               choices=ENCODING_ERRORS)
    num_eval: int = arg(256, "evaluate implicit accuracy on at most this many held-out pairs", group="data", min=1)


@dataclass
class ImageRLConfig(RunArgs, OnlineConfig):
    """Fields of the online image scripts (on top of ``OnlineConfig``'s loop and algorithm knobs)."""

    ALIASES = {"reward": "reward_funcs"}  # --reward: another name of --reward_funcs (unialign.trl_compat)

    model_name_or_path: str = arg("runwayml/stable-diffusion-v1-5", "SD1.x / SDXL / SD3 / FLUX.1 / Z-Image hub id or "
                                  "local diffusers folder", group="model")
    model_family: str = arg("auto", "auto (a folder's model_index.json, else the hub id's name) | " + family_names(),
                            group="model", choices=FAMILY_CHOICES)
    prompt_set: str = arg("animals", "'animals' (ddpo-pytorch's list), a .txt file (one prompt per line) or a "
                          ".jsonl file (a 'prompt' and other columns per line, given to the rewards: GenEval's "
                          "metadata files as they are)", group="data")
    encoding_errors: str = arg("strict", "a --prompt_set file that is not valid UTF-8: 'strict' (refuse it, "
                               "naming file:line) or 'replace' (read each bad byte as U+FFFD)",
                               group="data", choices=ENCODING_ERRORS)
    eval_prompt_set: str | None = arg(None, "held-out prompts: a prompt file (as --prompt_set), or 'train' to evaluate "
                                      "on the training prompts (labelled so in summary.json, comparison.png and the "
                                      "log); unset: a seeded --eval_fraction of the prompt set is held out (the "
                                      "embedded world's own held-out prompts for 'embedded')", group="data")
    eval_fraction: float = arg(0.1, "share of the --prompt_set held out when no --eval_prompt_set is given (at least "
                               "one prompt; a fixed split seed, 0, so every run holds out the same prompts)",
                               group="data", gt=0.0, lt=1.0)
    reward_funcs: str = arg("aesthetic", "comma-separated rewards (TRL's name; --reward too): registry names "
                            "(aesthetic, clip_score, shape_verifier, jpeg_compressibility, ...) or your own "
                            "function as module:function", group="algorithm")
    reward_weights: str | None = arg(None, "comma-separated floats, one per reward", group="algorithm")
    num_steps: int = arg(8, "denoising steps per sample", group="algorithm", min=1)
    guidance_scale: float = arg(1.0, "classifier-free guidance weight (<= 1: off)", group="algorithm", min=0.0)
    eta: float = arg(1.0, "DDIM eta (> 0: the stochastic steps RL needs; SD1.x / SDXL)",
                     group="algorithm", min=0.0)
    noise_level: float = arg(0.7, "flow matching (SD3 / FLUX): the SDE step's noise level eta (Flow-GRPO: 0.7 "
                             "for sde, 0.8 for cps)", group="algorithm", min=0.0)
    sde_type: str = arg("sde", "flow matching: sde (Flow-GRPO's marginal-preserving SDE) | cps "
                        "(coefficient-preserving sampling)", group="algorithm", choices=("sde", "cps"))
    sde_window_size: int = arg(0, "flow matching: only a window of this many consecutive steps per sampling call "
                               "is stochastic and trained, the rest deterministic Euler steps (Flow-GRPO-Fast / "
                               "MixGRPO); 0: every step", group="algorithm", min=0)
    sde_window_range: str | None = arg(None, "flow matching: 'lo,hi' -- the window starts uniformly in [lo, hi - "
                                       "size] (default: 0,num_steps)", group="algorithm")
    max_sequence_length: int | None = arg(None, "flow matching: T5 prompt tokens (default: the policy's, SD3's "
                                          "stock 256; FLUX.1-dev 512)", group="model", min=1)
    resolution: int | None = arg(None, "image side in pixels (default: the model's)", group="model", min=8)
    num_frames: int | None = arg(None, "video families (Wan): frames per clip, 4k + 1 (default: the model's; "
                                 "WanPipeline's 81)", group="model", min=1)
    frame_reduction: str = arg("mean", "video families: an image reward scores every frame, and a clip scores the "
                               "frames' mean or their min (the worst frame)", group="algorithm",
                               choices=("mean", "min"))
    timestep_fraction: float = arg(0.25, "share of the trainable steps trained per sample (SD1.x / SDXL; flow "
                                   "matching trains its SDE window)", group="algorithm", gt=0.0, max=1.0)
    min_step_std: float = arg(0.05, "never train steps whose noise std sigma_t is below this (their 1/sigma "
                              "gradients are mostly noise; SD's DDIM schedule at eta 1 ends in two steps of "
                              "sigma 0.04 / 0.02 at any step count; SD1.x / SDXL)", group="algorithm", min=0.0)
    lora_rank: int = arg(0, "> 0: train a LoRA of this rank instead of the full UNet / transformer",
                         group="model", min=0)
    lora_alpha: float | None = arg(None, "LoRA alpha (default: the rank)", group="model", gt=0.0)
    cfg_uncond_grad: bool | None = arg(
        None, "with CFG in training: true = gradients through both branches (DDPO as published, the SD1.x / SDXL "
        "default), false = the unconditional branch under no_grad (Flow-GRPO, the SD3 default; less compute and "
        "memory, a different gradient); unset: the policy's default", group="model")
    train_chunk_size: int = arg(0, "(sample, step) pairs per forward/backward in training: a micro-batch's "
                                "trained steps in chunks of this many, one backward each, the same update (0: "
                                "all in one UNet call; memory only)", group="optimisation", min=0)
    sample_batch_size: int = arg(0, "images denoised at once while sampling (0: the whole step's batch; memory "
                                 "only)", group="optimisation", min=0)
    # forward-process RL (--algorithm awm | nft | dgpo; unset: the algorithm's published values, FORWARD_PROCESS)
    sampler: str = arg("auto", "forward-process algorithms: the deterministic collection solver (auto: Euler for "
                       "flow matching, DDIM eta 0 for UNets; dpmpp: DPM-Solver++ 2M, UNets)",
                       group="algorithm", choices=("auto", "euler", "ddim", "dpmpp"))
    train_timesteps: int | None = arg(None, "forward-process algorithms: training pairs (t, eps) per sample (AWM "
                                      "6, DiffusionNFT int(N x 0.99), DGPO 4)", group="algorithm", min=1)
    forward_fraction: float | None = arg(None, "forward-process algorithms: the share of the solver's schedule "
                                         "the pairs' times come from (AWM 0.9, DiffusionNFT 0.99, DGPO 0.5)",
                                         group="algorithm", gt=0.0, max=1.0)
    forward_weighting: str | None = arg(None, "AWM: the matching log-prob's time weighting (uniform | t | t2 | "
                                        "ghuber; AWM's default ghuber)",
                                        group="algorithm", choices=("uniform", "t", "t2", "ghuber"))
    ghuber_power: float = arg(0.25, "AWM: the ghuber weighting's power p", group="algorithm", gt=0.0)
    old_policy_decay: str | None = arg(None, "forward-process algorithms: the old policy, a moving average of "
                                       "the trained weights, decayed per step by 'nft' (DiffusionNFT: min(0.001 "
                                       "step, 0.5)), 'awm' (AWM's and DGPO's: min(0.001 step, 0.3)), a constant in "
                                       "[0, 1), or 'off' (unset: the algorithm's: DiffusionNFT samples from it and "
                                       "mixes it into its loss, AWM's trust term and DGPO's clip read it)",
                                       group="algorithm")
    torch_dtype: str = arg("float32", "UNet / text-encoder dtype (the VAE runs in fp32)",
                           group="model", choices=DTYPES)
    num_eval: int = arg(168, "held-out images (prompts cycled), sampled with eval_seed", group="data", min=1)
    eval_seed: int = arg(1234, "seed of the held-out samples: the same noise every time", group="logging")
    eval_steps: int = arg(10, "held-out evaluation every N steps (curves, TensorBoard)")
    num_threads: int = arg(1, "torch CPU threads (tiny models: 1 is fastest; <= 0 leaves torch's choice)")



@dataclass
class ImageRLDefaults(ImageRLConfig):
    """``ImageRLConfig`` with the defaults the online image scripts (grpo_image.py, ddpo_aesthetic.py) share, measured
    on the embedded world (docs/images.md, "The embedded defaults, measured"); each script sets its own beta,
    algorithm, rewards and steps."""

    guidance_scale: float = default(1.0)
    timestep_fraction: float = default(0.5)
    kl_estimator: str | None = arg("gaussian", "gaussian (the exact closed-form step KL, the image default) | "
                                   "gaussian_g2 (Flow-GRPO's: the exact KL x |dt|, flow matching) | k1 | k2 | k3")
    epsilon: float | None = default(1e-2)
    learning_rate: float = default(1e-4)
    lr_scheduler_type: str = default("cosine")
    prompts_per_step: int = default(4)
    num_mini_batches: int = default(2)
    micro_batch_size: int = default(32)
    eval_steps: int = default(50)

def family_of(model_name_or_path: str, family: str = "auto") -> str:
    """The name of the family of ``model_name_or_path`` (``unialign.image.families.resolve``: ``family``, or with
    "auto" a local folder's ``model_index.json`` pipeline class, else the hub id's name)."""
    return resolve(model_name_or_path, family).name


def model_family(cfg: ImageRLConfig) -> str:
    """The family of ``cfg.model_name_or_path`` (``family_of`` with ``cfg.model_family``)."""
    return family_of(cfg.model_name_or_path, cfg.model_family)


def sample_kind(cfg: ImageRLConfig, family: str | None = None) -> str:
    """What ``cfg``'s model samples, "image" or "video" (its family's ``output_kind``; ``family``: the family's
    name when the caller knows it)."""
    return get_family(family or model_family(cfg)).output_kind[0]


def build_rewards(cfg: ImageRLConfig, names: list[str], weights: list[float] | None, kind: str,
                  reward_kwargs: Callable[[str], dict[str, Any]] = lambda name: {}) -> CombinedReward:
    """The ``CombinedReward`` of the reward ``names`` (each built with ``reward_kwargs(name)``) for a model that
    samples ``kind``: on a video model an image reward (``unialign.rewards.registry.LIFTED``) scores every frame
    and each clip the ``cfg.frame_reduction`` of them (``PerFrameReward``), under the image reward's name."""
    from unialign.rewards import RewardFunction
    from unialign.rewards.registry import lifted
    from unialign.rewards.video import PerFrameReward

    rewards = []
    for name in names:
        reward = get_reward(name, **reward_kwargs(name))
        if lifted(name, kind):
            reward = RewardFunction(PerFrameReward(reward, reduction=cfg.frame_reduction), name=reward.name)
        rewards.append(reward)
    return CombinedReward(rewards, weights, timeout_s=getattr(cfg, "reward_timeout", None))


def load_denoiser(model_name_or_path: str, family: str = "auto", torch_dtype: str | None = None,
                  vae_name_or_path: str | None = None, **kwargs: Any):
    """The policy of a hub id / diffusers folder for its family (``unialign.image.families.FAMILIES``: the
    adapter's ``policy``, ``DiffusionPolicy`` for SD1.x / SDXL, ``FlowPolicyBase`` for the flow families, told the
    family when ``family`` names one); ``kwargs`` go to its constructor. Each fails in seconds offline.
    ``vae_name_or_path`` (a replacement VAE) is for the families that take one (SD1.x / SDXL)."""
    row = resolve(model_name_or_path, family)
    extra = {}
    if vae_name_or_path is not None:
        if not row.replacement_vae:
            takes = " / ".join(f.title for f in FAMILIES.values() if f.replacement_vae)
            raise ValueError(f"vae_name_or_path: a replacement VAE is for {takes}, not {row.name}")
        extra["vae_name_or_path"] = vae_name_or_path
    return row.load(model_name_or_path, guessed=family == "auto", torch_dtype=torch_dtype, **extra, **kwargs)


def window_range(cfg: ImageRLConfig) -> tuple[int, int] | None:
    """``cfg.sde_window_range`` ("lo,hi") as a tuple (ValueError naming the field)."""
    if cfg.sde_window_range is None:
        return None
    try:
        lo, hi = (int(v) for v in cfg.sde_window_range.split(","))
    except ValueError:
        raise ValueError(f"sde_window_range: {cfg.sde_window_range!r} is not 'lo,hi' (two integers)") from None
    return lo, hi


def check_sampling_knobs(cfg: ImageRLConfig, family: str | Family) -> None:
    """The sampling knobs a ``family`` policy checks (a name or a ``FAMILIES`` row), checked from ``cfg`` alone
    before any model loads (one ValueError naming the field): those of the family's step kernel (its
    ``check_knobs``: the SDE window against ``num_steps`` and eta for its step type, DDIM's eta > 0) and the
    forward-process solver."""
    from unialign.image.kernels import KERNELS, ForwardKernel

    row = get_family(family)
    if cfg.num_frames is not None and "num_frames" not in row.knobs:
        video = ", ".join(n for n, f in FAMILIES.items() if "num_frames" in f.knobs)
        raise ValueError(f"num_frames: the {row.title} family makes images; --num_frames is for video families "
                         f"({video})")
    KERNELS[row.kernel].check_knobs(sampler_knobs(cfg, row))
    forward = forward_process_kwargs(cfg)
    if forward is not None:
        try:  # a solver for the family
            ForwardKernel._solver_kind(forward["sampler"], row.kernel)
        except ValueError as err:
            raise ValueError(f"sampler: {err}") from None


def sampler_knobs(cfg: ImageRLConfig, family: str | Family = "sd") -> SamplerKnobs:
    """The sampler knobs of ``cfg`` that apply to ``family`` (a name or a ``FAMILIES`` row), one frozen value;
    the unset optional ones (``resolution``, ``max_sequence_length``) None: the policy's default."""
    return SamplerKnobs(
        num_steps=cfg.num_steps, guidance_scale=cfg.guidance_scale, height=cfg.resolution, width=cfg.resolution,
        eta=cfg.eta, timestep_fraction=cfg.timestep_fraction, min_step_std=cfg.min_step_std,
        noise_level=cfg.noise_level, sde_type=cfg.sde_type, sde_window_size=cfg.sde_window_size,
        sde_window_range=window_range(cfg), max_sequence_length=cfg.max_sequence_length,
        num_frames=cfg.num_frames,
    ).for_family(get_family(family))


def policy_kwargs(cfg: ImageRLConfig, family: str | Family = "sd") -> dict[str, Any]:
    """The policy constructor's arguments from ``cfg`` for ``family`` (a name or a ``FAMILIES`` row): its sampler
    knobs as one value (``knobs``, ``sampler_knobs``), the LoRA, memory and seed knobs."""
    kw = dict(knobs=sampler_knobs(cfg, family), lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
              train_chunk_size=cfg.train_chunk_size, sample_batch_size=cfg.sample_batch_size, seed=cfg.seed)
    if cfg.cfg_uncond_grad is not None:  # unset: the policy's default
        kw["cfg_uncond_grad"] = cfg.cfg_uncond_grad
    return kw


# The policy side of the forward-process algorithms, by algorithm (the trainer side is unialign.registry's):
# AWM (scxue/advantage_weighted_matching, config/dgx_awm.py GenEval): 6 pairs per sample stratified over the
# solver's steps 1 .. int(0.9 N) - 1 ("discrete_wo_init"), ghuber weighting p 0.25, collection by the current policy;
# its trust term's old policy a moving average decayed by min(0.001 step, 0.3) (kl_ema_decay, linear);
# DiffusionNFT (NVlabs/DiffusionNFT, config/nft.py): int(0.99 N) pairs, a random subset of the N steps per sample,
# collection by the old policy, a moving average of the trained one decayed by min(0.001 step, 0.5);
# DGPO (Luo-Yihong/DGPO config/dgpo_wocfg.py geneval): K = 4 of the first trunc_steps + 1 = 5 of 10 steps (the
# noisiest half), drawn at random and shared with their noise by each group (use_shared_noise), the plain velocity
# MSE, collection by the current policy, the clip's old policy decayed by min(0.001 step, 0.3) (ema_ref).
FORWARD_PROCESS = {
    "awm": dict(train_timesteps=6, timestep_fraction=0.9, time_sampling="stratified", weighting="ghuber",
                old_policy_decay="awm", sample_old=False, share_pairs=False),
    "nft": dict(train_timesteps=None, timestep_fraction=0.99, time_sampling="random", weighting="uniform",
                old_policy_decay="nft", sample_old=True, share_pairs=False),
    "dgpo": dict(train_timesteps=4, timestep_fraction=0.5, time_sampling="random", weighting="uniform",
                 old_policy_decay="awm", sample_old=False, share_pairs=True, clip_reads_old=True),
}
OLD_DECAYS = {"nft": lambda step: min(0.001 * step, 0.5), "awm": lambda step: min(0.001 * step, 0.3)}


def old_decay(value: str | None) -> Callable[[int], float] | None:
    """``--old_policy_decay`` as a schedule step -> decay (None: no old policy); ValueError naming the field."""
    if value in (None, "off"):
        return None
    if value in OLD_DECAYS:
        return OLD_DECAYS[value]
    try:
        constant = float(value)
    except ValueError:
        raise ValueError(f"old_policy_decay: {value!r} is not {', '.join(map(repr, OLD_DECAYS))}, 'off' or a number "
                         "in [0, 1)") from None
    if not 0.0 <= constant < 1.0:
        raise ValueError(f"old_policy_decay: a constant decay must be in [0, 1), got {constant}")
    return lambda step: constant


def forward_process_kwargs(cfg: ImageRLConfig) -> dict[str, Any] | None:
    """The forward kernel's knobs (``DenoiserPolicy.use_forward_process``) for ``cfg``'s algorithm, or None when
    it trains on the sampler's steps: the algorithm's ``FORWARD_PROCESS`` entry (AWM's for another forward-process
    algorithm) under the set fields. Checked before any model loads."""
    if cfg.algo_spec().log_prob_estimator != "forward":
        return None
    base = FORWARD_PROCESS.get(cfg.algorithm, FORWARD_PROCESS["awm"])
    fraction = cfg.forward_fraction or base["timestep_fraction"]
    k = cfg.train_timesteps or base["train_timesteps"] or max(1, int(cfg.num_steps * fraction))
    decay_name = cfg.old_policy_decay or base["old_policy_decay"]
    decay = old_decay(decay_name)
    if base.get("clip_reads_old") and decay is None and (epsilon := cfg.algo_spec().epsilon) < 1.0:
        raise ValueError(f"old_policy_decay=off: {cfg.algorithm}'s clip (epsilon={epsilon}) compares each error with "
                         "the old policy's, which 'off' does not keep: set --old_policy_decay (e.g. awm) or --epsilon 1 "
                         "(no clip)")
    kw = dict(train_timesteps=k, timestep_fraction=fraction, time_sampling=base["time_sampling"],
              weighting=cfg.forward_weighting or base["weighting"], power=cfg.ghuber_power, sampler=cfg.sampler,
              sample_old=decay is not None and base["sample_old"], share_pairs=base["share_pairs"], old_decay=decay)
    if kw["share_pairs"] and cfg.sample_batch_size > 0 and cfg.sample_batch_size % cfg.num_generations:
        raise ValueError(f"sample_batch_size={cfg.sample_batch_size}: {cfg.algorithm} shares each group's pairs, "
                         f"which a sampling chunk must hold whole: a multiple of num_generations={cfg.num_generations} "
                         "(or 0)")
    from unialign.image.kernels import ForwardKernel

    try:  # the kernel's own checks, now
        ForwardKernel(cfg.num_steps, **{k: v for k, v in kw.items() if k != "old_decay"})
    except ValueError as err:
        raise ValueError(f"train_timesteps / forward_fraction / sampler: {err}") from None
    return kw


def load_prompt_rows(name: str, encoding_errors: str = "strict", field: str = "prompt_set") -> list[dict]:
    """The rows ``{"prompt": ..., <other columns>}`` of a prompt set: ``'animals'`` (ddpo-pytorch's list), a .txt
    file (one prompt per line, read a line at a time; a line that is not UTF-8 is refused naming ``file:line``
    unless ``encoding_errors="replace"``) or a ``.jsonl`` file: one JSON object per line with a string ``prompt``
    and any other columns, which reach the rewards as TRL's dataset columns (GenEval's / Flow-GRPO's
    ``*_metadata.jsonl`` files work as they are: ``tag``, ``include``, ``exclude``). A bad line is refused naming
    ``file:line`` (errors name ``field``). ``split_prompt_rows`` makes the train / held-out split."""
    import json

    from unialign.data import BOM, decode_text

    if name == "animals":
        return [{"prompt": p} for p in ANIMALS]
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(f"{field}: {name!r} is neither 'animals' nor a prompt file")
    rows = []
    with path.open("rb") as f:
        for i, raw in enumerate(f, start=1):
            line = decode_text(path, raw.removeprefix(BOM) if i == 1 else raw, encoding_errors, i).strip()
            if not line:
                continue
            if path.suffix != ".jsonl":
                rows.append({"prompt": line})
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{field}: {path}:{i} is not JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise ValueError(f"{field}: {path}:{i} needs a non-empty string 'prompt'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{field}: {name!r} has no prompts")
    return rows


EVAL_ON_TRAIN = "train"  # --eval_prompt_set train: evaluate on the training prompts, labelled so
SPLIT_SEED = 0  # the held-out share of a prompt set: the same prompts in every run


def split_prompt_rows(cfg: Any, named: dict[str, tuple[list[dict], list[dict]]] | None = None
                      ) -> tuple[list[dict], list[dict], str]:
    """(train, held-out, eval_source) of ``cfg.prompt_set``: a set in ``named`` (e.g. the embedded world's own
    train / test prompts) as it is split; any other set read by ``load_prompt_rows`` and split: a seeded
    ``cfg.eval_fraction`` held out (at least one prompt, at least one left to train; distinct prompts never on
    both sides). ``cfg.eval_prompt_set`` replaces the held-out side: a prompt file, or ``'train'`` (the training
    prompts, which ``eval_source`` then says: the number is not a held-out one). ``eval_source`` is the one line
    (starting "held out:" only when no evaluation prompt is trained on)
    ``summary.json``, the log and ``comparison.png`` carry. A set too small to split is refused naming the fix."""
    import random

    name, eval_set = cfg.prompt_set, getattr(cfg, "eval_prompt_set", None)
    errors = getattr(cfg, "encoding_errors", "strict")
    if named and name in named:
        train, held_out = named[name]
        source = f"held out: the {name} prompt set's own held-out prompts ({len(held_out)})"
    else:
        rows = load_prompt_rows(name, errors)
        if eval_set is not None:
            train, held_out, source = rows, [], ""
        else:
            distinct = list(dict.fromkeys(r["prompt"] for r in rows))
            n_eval = max(1, round(cfg.eval_fraction * len(distinct)))
            if len(distinct) - n_eval < 1:
                raise ValueError(
                    f"prompt_set: {name!r} has {len(distinct)} distinct prompt(s), too few to hold any out; give "
                    f"--eval_prompt_set FILE (held-out prompts) or --eval_prompt_set {EVAL_ON_TRAIN} (evaluate on "
                    f"the training prompts, labelled so)")
            chosen = set(random.Random(SPLIT_SEED).sample(distinct, n_eval))
            train = [r for r in rows if r["prompt"] not in chosen]
            held_out = [r for r in rows if r["prompt"] in chosen]
            source = (f"held out: {n_eval} of the {len(distinct)} prompts of {name} (eval_fraction "
                      f"{cfg.eval_fraction}, split seed {SPLIT_SEED}), none trained on")
    if eval_set == EVAL_ON_TRAIN:
        held_out = train
        source = f"training prompts (--eval_prompt_set {EVAL_ON_TRAIN}): not held out"
    elif eval_set is not None:
        held_out = load_prompt_rows(eval_set, errors, "eval_prompt_set")
        seen = {r["prompt"] for r in train}
        shared = len({r["prompt"] for r in held_out if r["prompt"] in seen})
        source = (f"eval_prompt_set {eval_set} ({len(held_out)} prompts; {shared} of them also train, so not all "
                  f"held out)" if shared else f"held out: eval_prompt_set {eval_set} ({len(held_out)} prompts, "
                  f"none trained on)")
    return train, held_out, source


def check_reward_rows(names: list[str], rows: list[dict], field_name: str = "prompt_set",
                      geneval_columns: bool = True) -> None:
    """Before any model loads: what the verifiable rewards need of each row -- GenEval's metadata (``geneval``;
    ``geneval_columns=False``: only where given, the backend reading the others from their prompts, as the
    shapes world's does), a quoted target (``ocr``); a ValueError naming the field and row."""
    if "geneval" in names and (geneval_columns or any("include" in r for r in rows)):
        from unialign.rewards.geneval import parse_metadata

        for i, r in enumerate(rows):
            if "include" not in r:
                raise ValueError(f"{field_name}[{i}]: the geneval reward needs GenEval metadata (a .jsonl prompt set "
                                 f"with tag / include / exclude columns, GenEval's format), got only a prompt")
            parse_metadata(r, f"{field_name}[{i}] (geneval metadata)")  # GenEval's ten colours
    if "ocr" in names:
        from unialign.rewards.ocr import ocr_targets

        try:
            ocr_targets([r["prompt"] for r in rows])
        except ValueError as err:
            raise ValueError(f"{field_name}: {err}") from None


def load_policy(cfg: ImageRLConfig):
    """The policy of ``cfg.model_name_or_path`` with ``cfg``'s sampling knobs (``load_denoiser``)."""
    return load_denoiser(cfg.model_name_or_path, cfg.model_family, cfg.torch_dtype,
                         **policy_kwargs(cfg, model_family(cfg)))


NAMED_PROMPT_SETS = ("animals",)  # prompt sets by name (load_prompt_rows); anything else is a file


def check_hub_prompt_set(prompt_set: str, model_name_or_path: str) -> None:
    """A FileNotFoundError naming the fix when a hub / local model's ``prompt_set`` is neither a named set
    nor a file -- e.g. the image scripts' default, their demo world's own prompts, which only its models have."""
    if prompt_set in NAMED_PROMPT_SETS or Path(prompt_set).is_file():
        return
    from unialign.errors import did_you_mean

    raise FileNotFoundError(
        f"prompt_set: {prompt_set!r} is no prompt file here{did_you_mean(prompt_set, NAMED_PROMPT_SETS)}; a hub or "
        f"local model ({model_name_or_path!r}) needs --prompt_set: a prompt file (.txt, one prompt per line, or .jsonl "
        f"with a 'prompt' column) or {' / '.join(repr(n) for n in NAMED_PROMPT_SETS)} (ddpo-pytorch's list)")


def hub_parts(cfg: ImageRLConfig) -> dict[str, Any]:
    """Policy, reward and prompts for a hub / local model (rewards with their published weights). A verifiable
    reward reports its verdict rate itself (``geneval``: ``rewards/geneval/strict``), so no second verifier
    runs the detector again on the held-out images. A script's default prompt set, the demo world's, is refused
    here, before anything loads, with the fix (``check_hub_prompt_set``)."""
    check_hub_prompt_set(cfg.prompt_set, cfg.model_name_or_path)
    names, weights = reward_names(cfg.reward_funcs, cfg.reward_weights)
    check_sampling_knobs(cfg, model_family(cfg))  # bad input named before any model loads
    train, held_out, eval_source = split_prompt_rows(cfg)
    check_reward_rows(names, train + held_out)
    reward = build_rewards(cfg, names, weights, sample_kind(cfg))
    return dict(policy=load_policy(cfg), reward=reward, train_prompts=train, eval_prompts=held_out,
                eval_source=eval_source)


def check_prompts(prompts: list[str], parse: Callable[[str], Any], field_name: str) -> None:
    """``parse`` every prompt; the first failure becomes a ValueError naming the field and row."""
    for i, prompt in enumerate(prompts):
        try:
            parse(prompt)
        except ValueError as err:
            raise ValueError(f"{field_name}[{i}]: {err}") from None


def run_image_rl(cfg: ImageRLConfig, policy, reward: CombinedReward, train_prompts: list[str | dict],
                 eval_prompts: list[str | dict], gold: Callable | None = None, verifier: Callable | None = None,
                 eval_source: str = "held out: the caller's eval_prompts") -> dict:
    """Train ``policy`` on ``train_prompts`` with the online trainer and ``reward``; evaluate on
    ``num_eval`` held-out samples (``eval_prompts`` cycled, fixed seed) before, every ``eval_steps`` and
    after: the reward (and each of its parts), prompt fidelity when a ``verifier`` is given (the
    all-three-right rate of a verifier such as the demo shapes world's), the ``gold`` score when given. Writes
    ``summary.json``, ``comparison.png`` (the first 32 held-out prompts before | after with their scores; its
    path is the summary's ``comparison_image``; the trackers get each evaluation's grid), the curves and
    ``final/`` (``DenoiserPolicy.save``: a whole pipeline folder, or the LoRA), and prints how to load it;
    returns the summary. Prompts are strings or rows ``{"prompt": ..., <columns>}`` (the columns
    reach the reward and the verifier, as TRL's dataset columns). ``eval_source`` says where the evaluation prompts
    come from (``split_prompt_rows``): it is logged at the start, kept in ``summary.json`` and names the numbers
    in ``comparison.png``'s title ("held-out" only when they are)."""
    start = time.time()
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    forward = forward_process_kwargs(cfg)
    if forward is not None:  # AWM / DiffusionNFT: train on the forward process, collect with a deterministic solver
        policy.use_forward_process(**forward)
    rows = [r if isinstance(r, dict) else {"prompt": r} for r in eval_prompts]
    rows = [rows[i % len(rows)] for i in range(cfg.num_eval)]
    prompts = [r["prompt"] for r in rows]
    columns = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r) if k != "prompt"}
    evaluator = HeldOutImages(policy, prompts, cfg.eval_seed, reward=reward, gold=gold, verifier=verifier,
                              columns=columns)
    trainer = OnlineTrainer(policy, reward, [r if isinstance(r, dict) else {"prompt": r} for r in train_prompts], cfg,
                            evaluator=evaluator)
    trainer.acc.print(f"evaluation prompts: {eval_source}")
    before, before_res = trainer.evaluate(), evaluator.last
    history = trainer.train()
    after, after_res = trainer.evaluate(), evaluator.last

    summary: dict[str, Any] = {
        "metric": "reward", "reward": cfg.reward_funcs, "before": before["eval/reward"], "after": after["eval/reward"],
        "before_std": before["eval/reward_std"], "after_std": after["eval/reward_std"],
        "gain_in_before_std": (after["eval/reward"] - before["eval/reward"]) / max(before["eval/reward_std"], 1e-12),
        "steps": trainer.step, "wall_seconds": time.time() - start, "num_eval": len(prompts),
        "eval_source": eval_source,
        "final_train_reward": next((h["reward/mean"] for h in reversed(history) if "reward/mean" in h), None)}
    # each part of a combined reward, and the batch metrics a reward reports (GenEval's strict rate: geneval/strict)
    for prefix in ("eval/reward/", "eval/rewards/"):
        for key in sorted(k for k in after if k.startswith(prefix) and k in before):
            summary[f"{key[len(prefix):]}_before"], summary[f"{key[len(prefix):]}_after"] = before[key], after[key]
    if verifier is not None:
        summary.update(fidelity_before=before["eval/fidelity"], fidelity_after=after["eval/fidelity"])
        for key in sorted(k for k in after if k.startswith("eval/fidelity/") and k in before):
            part = key[len("eval/fidelity/"):]
            summary[f"fidelity_{part}_before"], summary[f"fidelity_{part}_after"] = before[key], after[key]
    if gold is not None:
        summary.update(gold_before=before["eval/gold"], gold_after=after["eval/gold"])
    step_ratios = step_ratio_summary(history)
    if step_ratios:  # sampler-step methods: the importance ratio per denoising step over the run
        summary["step_ratios"] = step_ratios
    which = ("held-out" if eval_source.startswith("held out") else  # a train-prompt number is not held out
             "train-prompt" if eval_source.startswith("training prompts") else "eval")
    headline = [(f"{which} reward ({cfg.reward_funcs})", summary["before"], summary["after"])]
    if verifier is not None:
        headline.append(("prompt fidelity", summary["fidelity_before"], summary["fidelity_after"]))
    if "fidelity_reader_before" in summary:  # the second reading, which the reward never sees
        headline.append(("prompt fidelity, independent reader", summary["fidelity_reader_before"],
                         summary["fidelity_reader_after"]))
    return finish_image_run(trainer.acc, cfg, summary, policy, evaluator, (before_res, after_res), headline,
                            trainer.counters)


def train_image_pairs(cfg: Any, trainer, held_out: list[dict], images: HeldOutImages, own_data: bool,
                      counts: dict[str, int], data_info: dict[str, Any], start: float) -> dict[str, Any]:
    """The run of ``dpo_sdxl`` once its ``PreferenceTrainer`` is built: held-out images (``images``: the same prompts
    and seed before and after) and the held-out implicit accuracy, one (t, eps) draw and averaged over
    ``--eval_timestep_samples``, around ``trainer.train()``; then ``comparison.png``, ``final/`` and the summary,
    whose metric is the implicit accuracy on the user's pairs (``own_data``) or else the gold score, with the
    prompt fidelity beside it; ``counts`` (pairs trained, ties dropped, held-out pairs) and ``data_info`` (the
    data's source) go into the summary."""
    from unialign.trainers.preference import averaged_implicit_accuracy

    objective, results = trainer.obj, []

    def evaluate() -> tuple[dict, float, float]:  # held-out images, implicit accuracy K / 1
        metrics = images() if images.prompts else {}
        results.append(images.last)
        k1, k = trainer.evaluate(held_out)["implicit_accuracy"], cfg.eval_timestep_samples
        return metrics, (k1 if k <= 1 else averaged_implicit_accuracy(objective, held_out, k, cfg.eval_batch_size)), k1

    before, implicit_before, implicit_before_k1 = evaluate()
    history = [h for h in trainer.train() if "loss" in h]  # training steps (held-out evaluations are eval/* rows)
    after, implicit_after, implicit_after_k1 = evaluate()
    metric = "implicit_accuracy" if own_data else "gold_score"
    summary = {"metric": metric, "before": implicit_before if own_data else before["gold"],
               "after": implicit_after if own_data else after["gold"],
               "implicit_accuracy_before": implicit_before, "implicit_accuracy_after": implicit_after,
               **({} if own_data else {"fidelity_before": before["fidelity"], "fidelity_after": after["fidelity"]}),
               "implicit_accuracy_before_k1": implicit_before_k1, "implicit_accuracy_after_k1": implicit_after_k1,
               "eval_timestep_samples": cfg.eval_timestep_samples,
               "first_loss": history[0]["loss"] if history else None, "steps": trainer.step,
               **counts, "wall_seconds": time.time() - start, **data_info}
    return finish_image_run(trainer.acc, cfg, summary, objective.policy, images, tuple(results),
                            [(f"held-out {metric}", summary["before"], summary["after"])])
