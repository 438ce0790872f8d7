"""DiffusionPolicy on tiny SD1.x / SDXL models: sampling, log-prob recomputation, reference, LoRA, saving."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import assert_close
from unialign.image import DiffusionPolicy
from unialign.policy import Policy
from unialign.types import Trajectory

PROMPTS = ["a cat", "a dog", "a cat"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _perturb_lora(policy: DiffusionPolicy, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.unet.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_sample_shapes_and_on_policy_ratio(make_policy, kind):
    policy = make_policy(kind, lora_rank=2)
    assert isinstance(policy, Policy) and isinstance(policy.reference(), Policy)
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(0))
    n = policy.num_steps
    assert traj.payload["latents"].shape == (3, n + 1, 4, 8, 8)
    assert traj.payload["timesteps"].tolist() == [[751, 501, 251, 1]] * 3  # leading spacing, steps_offset=1
    assert traj.old_logp_B_T.shape == (3, n) and traj.mask_B_T.shape == (3, n)
    assert torch.equal(traj.mask_B_T, torch.ones(3, n))
    assert traj.truncated_B.tolist() == [False] * 3
    assert len(traj.completions) == 3
    assert all(isinstance(im, Image.Image) and im.size == (16, 16) for im in traj.completions)
    assert not traj.old_logp_B_T.requires_grad
    # the last recorded latent is what was decoded
    assert np.array_equal(np.asarray(traj.completions[1]), np.asarray(policy.decode(traj.payload["latents"][1:2, -1])[0]))

    logp = policy.log_prob(traj)
    assert logp.requires_grad
    assert_close(logp, traj.old_logp_B_T)  # ratio 1 on the first on-policy recomputation
    # a sub-batch (as a trainer's micro-batch) recomputes the same rows
    assert_close(policy.log_prob(traj.select([2, 0])), traj.old_logp_B_T[[2, 0]])


def test_same_prompt_same_generator_is_reproducible(make_policy):
    policy = make_policy("sd")
    a = policy.sample(["a cat"], generator=torch.Generator().manual_seed(5))
    b = policy.sample(["a cat"], generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.payload["latents"], b.payload["latents"])


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_gradients_reach_only_lora_params(make_policy, kind):
    policy = make_policy(kind, lora_rank=2)
    _perturb_lora(policy)  # lora_B starts at 0, which would zero the lora_A gradient
    traj = policy.sample(PROMPTS[:2], generator=torch.Generator().manual_seed(0))
    policy.log_prob(traj).sum().backward()
    trainable = {id(p) for p in policy.trainable_parameters()}
    assert trainable and all("lora_" in n for n, p in policy.unet.named_parameters() if id(p) in trainable)
    for name, p in policy.unet.named_parameters():
        if id(p) in trainable:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    frozen = [policy.vae, policy.text_encoder] + ([policy.text_encoder_2] if kind == "sdxl" else [])
    assert all(p.grad is None and not p.requires_grad for m in frozen for p in m.parameters())


def test_full_finetune_trains_the_whole_unet(make_policy):
    policy = make_policy("sd")
    traj = policy.sample(PROMPTS[:1], generator=torch.Generator().manual_seed(0))
    policy.log_prob(traj).sum().backward()
    params = list(policy.unet.parameters())
    assert len(list(policy.trainable_parameters())) == len(params)
    assert sum(p.grad is not None for p in params) > 0.9 * len(params)


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_reference_is_the_base_model(make_policy, kind):
    policy = make_policy(kind, seed=3, lora_rank=2)
    base = make_policy(kind, seed=3)  # same weights, no adapters
    traj = base.sample(PROMPTS[:2], generator=torch.Generator().manual_seed(1))
    ref = policy.reference()
    assert_close(ref.log_prob(traj), traj.old_logp_B_T)  # LoRA B = 0 at init: policy == base
    _perturb_lora(policy)
    ref_logp = ref.log_prob(traj)
    assert not ref_logp.requires_grad
    assert_close(ref_logp, base.log_prob(traj))  # adapters disabled == a fresh model without adapters
    trained = policy.log_prob(traj)
    assert (trained - ref_logp).abs().max() > 1e-3  # the perturbed LoRA changes the policy ...
    assert_close(policy.log_prob(traj), trained)  # ... and the adapters are back on after reference()
    chosen, rejected = ref.sequence_log_prob(_pair_batch(base, traj))
    chosen_base, rejected_base = base.sequence_log_prob(_pair_batch(base, traj))
    assert_close(chosen, chosen_base)
    assert_close(rejected, rejected_base)


def test_reference_without_lora_is_a_frozen_copy(make_policy):
    policy = make_policy("sd")
    traj = policy.sample(PROMPTS[:1], generator=torch.Generator().manual_seed(0))
    ref = policy.reference()
    assert ref.model is not policy.unet and ref.reference().model is ref.model
    with torch.no_grad():
        for p in policy.unet.parameters():
            p.add_(0.05)
    assert_close(ref.log_prob(traj), traj.old_logp_B_T)
    assert (policy.log_prob(traj) - traj.old_logp_B_T).abs().max() > 1e-3
    assert policy.reference().model is ref.model  # made once


def test_timestep_fraction_masks_and_skips_untrained_steps(make_policy):
    policy = make_policy("sd", num_steps=4, timestep_fraction=0.5)
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(0))
    mask = traj.mask_B_T
    assert mask.sum(dim=1).tolist() == [2.0, 2.0, 2.0]
    rows_seen = []
    hook = policy.unet.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[0]))
    try:
        logp, entropy = policy.log_prob_and_entropy(traj)
    finally:
        hook.remove()
    # ONE UNet call over every trained (sample, step) pair, nothing else (x2 for CFG)
    assert rows_seen == [2 * int(mask.sum())]
    assert torch.equal(logp[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert_close(logp[mask == 1], traj.old_logp_B_T[mask == 1])

    # entropy = 1/2 log(2 pi e sigma_t^2), float64 numpy, masked like logp
    acp = policy.scheduler.alphas_cumprod.double().numpy()
    t = traj.payload["timesteps"].numpy()
    a, ap = acp[t], acp[np.clip(t - 1000 // 4, 0, 999)]
    var = (1 - ap) / (1 - a) * (1 - a / ap)
    assert_close(entropy, 0.5 * np.log(2 * np.pi * np.e * var) * mask.numpy())


def test_timestep_fraction_is_drawn_from_the_generator(make_policy):
    policy = make_policy("sd", num_steps=4, timestep_fraction=0.25)
    masks = [policy._trained_steps_mask(8, torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])
    assert masks[0].sum(1).tolist() == [1.0] * 8
    assert len({tuple(row.tolist()) for row in masks[0]}) > 1  # drawn independently per sample


def test_trajectory_cat_keeps_log_prob(make_policy):
    policy = make_policy("sdxl")
    g = torch.Generator().manual_seed(0)
    parts = [policy.sample(["a cat"], generator=g), policy.sample(["a dog"], generator=g)]
    both = Trajectory.cat(parts)
    assert_close(policy.log_prob(both), both.old_logp_B_T)


def test_eta_and_xformers_errors(make_policy):
    with pytest.raises(ValueError, match="eta"):
        make_policy("sd", eta=0.0)
    try:
        import xformers  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="xformers"):
            make_policy("sd", enable_xformers=True)


def test_gradient_checkpointing_same_values(make_policy):
    policy = make_policy("sd", lora_rank=2, gradient_checkpointing=True)
    assert policy.unet.is_gradient_checkpointing
    traj = policy.sample(PROMPTS[:1], generator=torch.Generator().manual_seed(0))
    assert_close(policy.log_prob(traj), traj.old_logp_B_T)


# ---------------------------------------------------------------- preference (Diffusion-DPO surrogate)
def _pair_batch(policy: DiffusionPolicy, traj: Trajectory, same: bool = False, seed: int = 0):
    from unialign.types import PreferenceBatch

    g = torch.Generator().manual_seed(seed)
    b = len(traj)
    chosen = traj.payload["latents"][:, -1]
    rejected = chosen.clone() if same else torch.randn(chosen.shape, generator=g)
    return PreferenceBatch(prompts=traj.prompts, chosen={"latents": chosen}, rejected={"latents": rejected},
                           payload={"timesteps": torch.randint(0, 1000, (b,), generator=g),
                                    "noise": torch.randn(chosen.shape, generator=g)})


@pytest.mark.parametrize("kind, prediction_type", [("sd", "epsilon"), ("sd", "v_prediction"), ("sdxl", "epsilon")])
def test_sequence_log_prob_is_half_mse_by_hand(make_policy, kind, prediction_type):
    policy = make_policy(kind, prediction_type=prediction_type) if kind == "sd" else make_policy(kind)
    traj = policy.sample(PROMPTS[:2], generator=torch.Generator().manual_seed(0))
    batch = _pair_batch(policy, traj)
    chosen, rejected = policy.sequence_log_prob(batch)
    assert chosen.shape == (2,) and chosen.requires_grad

    acp = policy.scheduler.alphas_cumprod.double()
    cond = policy.encode_prompts(batch.prompts)
    added = None
    if kind == "sdxl":
        added = {"text_embeds": cond["pooled_prompt_embeds"],
                 "time_ids": torch.tensor([[16.0, 16, 0, 0, 16, 16]] * 2)}
    t, eps = batch.payload["timesteps"], batch.payload["noise"].double()
    a = acp[t].view(-1, 1, 1, 1)
    for side, got in (("chosen", chosen), ("rejected", rejected)):
        x0 = getattr(batch, side)["latents"].double()
        x_t = (a.sqrt() * x0 + (1 - a).sqrt() * eps).float()
        with torch.no_grad():
            pred = policy.unet(x_t, t, encoder_hidden_states=cond["prompt_embeds"], added_cond_kwargs=added).sample
        target = eps if prediction_type == "epsilon" else a.sqrt() * eps - (1 - a).sqrt() * x0
        expected = -0.5 * ((target - pred.double()) ** 2).mean(dim=(1, 2, 3))
        assert_close(got, expected, msg=side)


def test_sequence_log_prob_shares_t_and_noise_per_pair(make_policy):
    policy = make_policy("sd", seed=1)
    traj = policy.sample(PROMPTS[:2], generator=torch.Generator().manual_seed(0))
    batch = _pair_batch(policy, traj, same=True)
    batch.payload = {}  # t and eps drawn from the policy's generator
    chosen, rejected = policy.sequence_log_prob(batch)
    assert torch.equal(chosen, rejected)
    chosen2, _ = policy.sequence_log_prob(batch)
    assert not torch.equal(chosen, chosen2)  # a fresh (t, eps) per call


def test_sdxl_conditioning_tensors(make_policy):
    policy = make_policy("sdxl", height=16, width=16)
    assert policy.is_sdxl
    cond = policy.encode_prompts(["a cat", "a dog"])
    assert cond["prompt_embeds"].shape == (2, 8, 32 + 16)  # penultimate states of both encoders, concatenated
    assert cond["pooled_prompt_embeds"].shape == (2, 24)  # 2nd encoder's projection dim
    # the pooled output is the 2nd encoder's text_embeds; the widths come from hidden_states[-2]
    ids = policy.tokenizer_2(["a cat"], padding="max_length", max_length=8, return_tensors="pt").input_ids
    out = policy.text_encoder_2(ids, output_hidden_states=True)
    assert_close(cond["pooled_prompt_embeds"][0], out.text_embeds[0])
    assert_close(cond["prompt_embeds"][0, :, 32:], out.hidden_states[-2][0])
    assert policy.time_ids(2, original_size=(20, 24), crop_top_left=(2, 3)).tolist() == [[20, 24, 2, 3, 16, 16]] * 2
    traj = policy.sample(["a cat"], generator=torch.Generator().manual_seed(0))
    assert traj.payload["time_ids"].tolist() == [[16, 16, 0, 0, 16, 16]]
    assert traj.payload["pooled_prompt_embeds"].shape == (1, 24)


def test_encode_images_roundtrip_shapes(make_policy):
    policy = make_policy("sd")
    pixels = torch.rand(2, 3, 16, 16) * 2 - 1
    mean = policy.encode_images(pixels, sample_posterior=False)
    assert mean.shape == (2, 4, 8, 8)
    assert torch.equal(mean, policy.encode_images(pixels, sample_posterior=False))
    sampled = policy.encode_images(pixels, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == mean.shape and not torch.equal(sampled, mean)
    expected = policy.vae.encode(pixels).latent_dist.mean * policy.vae.config.scaling_factor
    assert_close(mean, expected)


# ---------------------------------------------------------------- saving / loading
@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_lora_save_loads_in_stock_pipeline(make_policy, tokenizer_dir, tmp_path, kind):
    from tests.image.conftest import stock_pipeline

    policy = make_policy(kind, seed=2, lora_rank=2, lora_alpha=4)  # alpha != rank: the scale must survive
    _perturb_lora(policy)
    policy.save(str(tmp_path))
    pipe = stock_pipeline(tokenizer_dir, kind, seed=2)
    pipe.load_lora_weights(str(tmp_path))

    g = torch.Generator().manual_seed(0)
    x, emb = torch.randn(2, 4, 8, 8, generator=g), policy.encode_prompts(["a cat", "a dog"])
    added = None
    if kind == "sdxl":
        added = {"text_embeds": emb["pooled_prompt_embeds"], "time_ids": policy.time_ids(2)}
    t = torch.tensor([900, 30])
    with torch.no_grad():
        ours = policy.unet(x, t, encoder_hidden_states=emb["prompt_embeds"], added_cond_kwargs=added).sample
        stock = pipe.unet(x, t, encoder_hidden_states=emb["prompt_embeds"], added_cond_kwargs=added).sample
        policy.unet.disable_adapters()
        base = policy.unet(x, t, encoder_hidden_states=emb["prompt_embeds"], added_cond_kwargs=added).sample
        policy.unet.enable_adapters()
    assert (ours - base).abs().max() > 1e-3
    assert_close(stock, ours)


def test_full_save_loads_with_from_pretrained(make_policy, tmp_path):
    from diffusers import UNet2DConditionModel

    policy = make_policy("sd")
    with torch.no_grad():
        next(policy.unet.parameters()).add_(1.0)
    policy.save(str(tmp_path))
    loaded = UNet2DConditionModel.from_pretrained(str(tmp_path), subfolder="unet")
    for (name, p), q in zip(policy.unet.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.filterwarnings("ignore:The `local_dir_use_symlinks`:UserWarning")  # huggingface_hub internals
def test_from_pretrained_offline_missing_id_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.time()
    with pytest.raises(RuntimeError, match="unialign-test/does-not-exist.*(cannot be downloaded here|not in the local cache)"):
        DiffusionPolicy.from_pretrained("unialign-test/does-not-exist")
    assert time.time() - start < 5


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_from_pretrained_local_folder(make_policy, tokenizer_dir, tmp_path, kind):
    from tests.image.conftest import stock_pipeline

    pipe = stock_pipeline(tokenizer_dir, kind, seed=4)
    pipe.save_pretrained(str(tmp_path))
    policy = DiffusionPolicy.from_pretrained(str(tmp_path), lora_rank=2, num_steps=2, guidance_scale=1.0)
    assert policy.is_sdxl == (kind == "sdxl")
    fresh = make_policy(kind, seed=4, num_steps=2, guidance_scale=1.0)
    traj = fresh.sample(["a cat"], generator=torch.Generator().manual_seed(0))
    assert_close(policy.log_prob(traj), traj.old_logp_B_T)
    assert math.isfinite(traj.old_logp_B_T.sum().item())


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_first_sampler_step_by_hand_with_cfg(make_policy, kind):
    """x_T ~ N(0, I) from the generator, then one DDIM step on eps_u + w (eps_c - eps_u), where eps_u
    conditions on the empty prompt; the recorded x_{t'} and log-prob match this hand computation."""
    from unialign.image import ddim_step_with_logprob

    policy = make_policy(kind, guidance_scale=4.0)
    traj = policy.sample(["a cat", "a dog"], generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    x_T = torch.randn(2, 4, 8, 8, generator=g)
    assert torch.equal(traj.payload["latents"][:, 0], x_T)
    t = traj.payload["timesteps"][:, 0]

    # one UNet call on [uncond; cond] as the sampler makes (a batch of 2 differs from one of 4 by ~1e-6
    # in float32, and w = 4 amplifies that past the float32 tolerance)
    # (and the empty prompt encoded once, batch 1, as the policy caches it)
    emb_u, emb_c = policy.encode_prompts([""]), policy.encode_prompts(["a cat", "a dog"])
    emb = {k: torch.cat([emb_u[k].expand_as(emb_c[k]), emb_c[k]]) for k in emb_c}
    added = None
    if kind == "sdxl":
        added = {"text_embeds": emb["pooled_prompt_embeds"], "time_ids": torch.tensor([[16.0, 16, 0, 0, 16, 16]] * 4)}
    with torch.no_grad():
        out = policy.unet(torch.cat([x_T, x_T]), torch.cat([t, t]), encoder_hidden_states=emb["prompt_embeds"],
                          added_cond_kwargs=added).sample
    eps_u, eps_c = out[:2], out[2:]
    guided = eps_u + 4.0 * (eps_c - eps_u)
    x_next, logp = ddim_step_with_logprob(policy.scheduler, guided, t, x_T, eta=1.0, generator=g)
    assert_close(traj.payload["latents"][:, 1], x_next)
    assert_close(traj.old_logp_B_T[:, 0], logp)


def test_min_step_std_keeps_the_nearly_deterministic_steps_untrained(make_policy):
    from unialign.image.ddim import ddim_step_coefficients

    policy = make_policy("sd", num_steps=8, timestep_fraction=0.5, min_step_std=0.1)
    std = ddim_step_coefficients(policy.scheduler, policy.scheduler.timesteps, policy.eta)["std"]
    low = (std < 0.1).nonzero().flatten().tolist()
    assert low == [6, 7] and policy.trainable_steps.tolist() == [0, 1, 2, 3, 4, 5]
    traj = policy.sample(PROMPTS * 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(traj.mask_B_T.sum(1), torch.full((12,), 3.0))  # half of the 6 trainable steps
    assert float(traj.mask_B_T[:, low].sum()) == 0.0
    assert (traj.mask_B_T[:, :6].sum(0) > 0).all()  # every trainable step is drawn by someone
    with pytest.raises(ValueError, match="leaves no trainable step"):
        make_policy("sd", min_step_std=5.0)
