"""``FluxPolicy`` (FLUX.1) on a tiny random-weight FLUX built in code (1 double + 1 single block, a tiny
CLIPTextModel and T5EncoderModel; the conftest's CLIP tokenizer stands in for T5's, which the policy only
calls): packing against the stock pipeline's, trajectory shapes and ratio 1 against a hand-made velocity,
eta -> 0 against the stock ``FluxPipeline``, the LoRA through stock ``load_lora_weights``, loading a stock
folder, and the Diffusion-DPO surrogate against a hand restatement."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.image.conftest import _text_config, _tokenizer, colour_pairs, log_probs_around_a_lora_move
from unialign import algos
from unialign.image.flow import sde_step_with_logprob
from unialign.image.flux_policy import FluxFamily, FluxPolicy, latent_image_ids, pack_latents, unpack_latents

PROMPTS = ["a cat", "a red circle"]
T5_TOKENS = 6
GUIDANCE = 3.5


def flux_components(tokenizer_dir, seed: int = 0) -> dict:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(  # 4 VAE channels packed 2x2 -> 16; CLIP pooled 32, T5 width 32
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                        norm_num_groups=4, layers_per_block=1, sample_size=16, scaling_factor=0.3611,
                        shift_factor=0.1159)  # FLUX's VAE factors
    t5 = T5EncoderModel(T5Config(vocab_size=520, d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=4,
                                 decoder_start_token_id=0, pad_token_id=0)).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler config
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096)
    return dict(transformer=transformer, vae=vae, text_encoder=CLIPTextModel(_text_config(32)).eval(),
                tokenizer=_tokenizer(tokenizer_dir), text_encoder_2=t5, tokenizer_2=_tokenizer(tokenizer_dir),
                scheduler=scheduler)


FLUX_DEFAULTS = dict(num_steps=4, guidance_scale=GUIDANCE, noise_level=0.7, max_sequence_length=T5_TOKENS,
                     height=16, width=16)


@pytest.fixture
def make_flux_policy(tokenizer_dir):
    def factory(seed: int = 0, **kwargs) -> FluxPolicy:
        return FluxPolicy(**flux_components(tokenizer_dir, seed), **{**FLUX_DEFAULTS, **kwargs})

    return factory


def stock_velocity(transformer, x_B_C_H_W, t_B, embeds, pooled, vae_scale_factor: int = 2):
    """The velocity the stock FluxPipeline computes, written out with its own static helpers."""
    from diffusers import FluxPipeline

    b, c, h, w = x_B_C_H_W.shape
    with torch.no_grad():
        out = transformer(
            hidden_states=FluxPipeline._pack_latents(x_B_C_H_W, b, c, h, w), timestep=t_B / 1000,
            guidance=torch.full((b,), GUIDANCE), pooled_projections=pooled, encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3), img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2,
                                                                                                   "cpu", x_B_C_H_W.dtype),
            return_dict=False)[0]
    return FluxPipeline._unpack_latents(out, h * vae_scale_factor, w * vae_scale_factor, vae_scale_factor)


def test_packing_matches_the_stock_pipeline():
    from diffusers import FluxPipeline

    x = torch.randn(3, 4, 6, 8)
    tokens = pack_latents(x)
    torch.testing.assert_close(tokens, FluxPipeline._pack_latents(x, 3, 4, 6, 8), rtol=0, atol=0)
    torch.testing.assert_close(unpack_latents(tokens, 6, 8), x, rtol=0, atol=0)
    torch.testing.assert_close(latent_image_ids(6, 8), FluxPipeline._prepare_latent_image_ids(3, 3, 4, "cpu",
                                                                                              torch.float32))


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_sample_shapes_and_ratio_one_against_the_stock_velocity(make_flux_policy, sde_type):
    noise = 0.7 if sde_type == "sde" else 0.8
    policy = make_flux_policy(sde_type=sde_type, noise_level=noise, sde_window_size=2, sde_window_range=(0, 3))
    traj = policy.sample(PROMPTS * 2, generator=torch.Generator().manual_seed(1))
    b, n = 4, 4
    lat = traj.payload["latents"]
    assert lat.shape == (b, n + 1, 4, 8, 8) and lat.dtype == torch.float32  # unpacked
    assert traj.payload["prompt_embeds"].shape == (b, T5_TOKENS, 32)
    assert traj.payload["pooled_prompt_embeds"].shape == (b, 32)
    assert traj.completions[0].size == (16, 16) and traj.mask_B_T.sum(1).tolist() == [2.0] * b
    # FluxPipeline's sigmas: linspace(1, 1/N, N) under the dynamic shift mu of 16 image tokens
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    mu = calculate_shift(16, 256, 4096, 0.5, 1.15)
    lin = torch.linspace(1, 1 / n, n, dtype=torch.float64)
    expected = math.exp(mu) / (math.exp(mu) + (1 / lin - 1))
    torch.testing.assert_close(policy.scheduler.sigmas[:n].double(), expected, atol=1e-6, rtol=0)

    logp = policy.log_prob(traj)
    trained = traj.mask_B_T > 0
    torch.testing.assert_close(logp[trained], traj.old_logp_B_T[trained], atol=1e-5, rtol=0)
    assert (logp[~trained] == 0).all() and logp.requires_grad
    i = int(trained[0].nonzero()[0])
    t = traj.payload["timesteps"][:, i]
    v = stock_velocity(policy.transformer, lat[:, i], t, traj.payload["prompt_embeds"], traj.payload["pooled_prompt_embeds"])
    _, kernel_logp, _, _ = sde_step_with_logprob(policy.scheduler, v, t, lat[:, i], noise, prev_sample=lat[:, i + 1],
                                                 sde_type=sde_type)
    torch.testing.assert_close(logp[:, i].detach(), kernel_logp, atol=1e-5, rtol=0)


def test_small_eta_approaches_the_stock_flux_pipeline(make_flux_policy):
    from diffusers import FluxPipeline

    gaps = []
    for eta in (1e-1, 1e-3):
        policy = make_flux_policy(noise_level=eta)
        traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(3))
        pipe = FluxPipeline(transformer=policy.transformer, vae=policy.vae, scheduler=copy.deepcopy(policy.scheduler),
                            text_encoder=policy.text_encoder, tokenizer=policy.tokenizer,
                            text_encoder_2=policy.text_encoder_2, tokenizer_2=policy.tokenizer_2)
        pipe.set_progress_bar_config(disable=True)
        x1 = traj.payload["latents"][:, 0]
        stock = pipe(PROMPTS, num_inference_steps=4, guidance_scale=GUIDANCE, latents=pack_latents(x1),
                     output_type="latent", max_sequence_length=T5_TOKENS, height=16, width=16).images
        gaps.append(float((traj.payload["latents"][:, -1] - unpack_latents(stock, 8, 8)).abs().max()))
    assert gaps[1] < 1e-2 and gaps[1] < gaps[0] / 10, gaps


def test_lora_reference_and_stock_load_lora_weights(make_flux_policy, tokenizer_dir, tmp_path):
    from diffusers import FluxPipeline

    policy = make_flux_policy(lora_rank=2)
    ref = policy.reference()
    names = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora" in n for n in names)
    assert any("single_transformer_blocks" in n for n in names) and any("ff_context" in n for n in names)
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(2))
    before, after, ref_after = log_probs_around_a_lora_move(policy, ref, traj)
    with torch.no_grad():
        _, _, kl = policy.log_prob_and_kl(traj)
    torch.testing.assert_close(ref_after, before, atol=1e-6, rtol=0)
    assert (after - ref_after).abs().max() > 1e-4 and (kl > 0).all()
    policy.save(str(tmp_path / "lora"))

    pipe = FluxPipeline(**flux_components(tokenizer_dir))  # fresh copy of the base weights
    pipe.set_progress_bar_config(disable=True)
    x, t = traj.payload["latents"][:, 1], traj.payload["timesteps"][:, 1]
    embeds, pooled = traj.payload["prompt_embeds"], traj.payload["pooled_prompt_embeds"]
    trained = stock_velocity(policy.transformer, x, t, embeds, pooled)
    v_base = stock_velocity(pipe.transformer, x, t, embeds, pooled)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    v_loaded = stock_velocity(pipe.transformer, x, t, embeds, pooled)
    torch.testing.assert_close(v_loaded, trained, atol=1e-5, rtol=0)
    assert (v_loaded - v_base).abs().max() > 1e-3
    out = pipe(PROMPTS, num_inference_steps=2, guidance_scale=GUIDANCE, max_sequence_length=T5_TOKENS, height=16,
               width=16, output_type="latent", generator=torch.Generator().manual_seed(0)).images
    assert torch.isfinite(out).all()


def test_from_pretrained_loads_a_stock_flux_folder(tokenizer_dir, tmp_path, monkeypatch):
    from diffusers import FluxPipeline

    FluxPipeline(**flux_components(tokenizer_dir)).save_pretrained(str(tmp_path / "flux"))
    policy = FluxPolicy.from_pretrained(str(tmp_path / "flux"), lora_rank=2, num_steps=3,
                                        max_sequence_length=T5_TOKENS, height=16, width=16)
    assert policy.scheduler.config.use_dynamic_shifting and policy.transformer.config.guidance_embeds
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(policy.log_prob(traj), traj.old_logp_B_T, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"multiples of 4 .*got 16 x 18"):  # VAE factor 2 x the 2x2 packing
        FluxPolicy(**flux_components(tokenizer_dir), **{**FLUX_DEFAULTS, "width": 18})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="black-forest-labs/not-a-real-flux"):
        FluxPolicy.from_pretrained("black-forest-labs/not-a-real-flux")


def pairs(n: int = 3) -> list[dict]:
    return colour_pairs(PROMPTS, n, rejected_size=(20, 16))


def test_dpo_surrogate_against_a_hand_restatement(make_flux_policy):
    policy = make_flux_policy()
    batch = policy.preference_batch(pairs())
    pay = batch.payload
    assert pay["timesteps"].shape == pay["sigmas"].shape == (3,) and pay["noise"].shape == (3, 4, 8, 8)
    table = policy.train_timesteps  # uniform over the 1000 unshifted training timesteps (dynamic shifting)
    assert len(table) == 1000 and all(bool((table == t).any()) for t in pay["timesteps"])
    torch.testing.assert_close(pay["sigmas"], pay["timesteps"] / 1000)
    # latents: (z - shift) * scale of the VAE posterior (its mean here: deterministic)
    from unialign.image.data import to_pixels

    pix = torch.stack([to_pixels(r["chosen"], 16)[0] for r in pairs()])
    with torch.no_grad():
        mean = policy.vae.encode(pix).latent_dist.mean
    torch.testing.assert_close(policy.encode_images(pix, sample_posterior=False), (mean - 0.1159) * 0.3611)

    chosen, rejected = policy.sequence_log_prob(batch)
    assert chosen.requires_grad and chosen.shape == rejected.shape == (3,)
    s = pay["sigmas"].view(-1, 1, 1, 1)
    for side, got in ((batch.chosen, chosen), (batch.rejected, rejected)):
        x0 = side["latents"]
        v = stock_velocity(policy.transformer, (1 - s) * x0 + s * pay["noise"], pay["timesteps"], pay["prompt_embeds"],
                           pay["pooled_prompt_embeds"])
        torch.testing.assert_close(got.detach(), -0.5 * ((v - (pay["noise"] - x0)) ** 2).mean(dim=(1, 2, 3)),
                                   atol=1e-6, rtol=1e-5)


def test_identical_pair_gives_ln2(make_flux_policy):
    policy = make_flux_policy(lora_rank=2)
    batch = policy.preference_batch(pairs())
    batch.rejected = dict(batch.chosen)
    c, r = policy.sequence_log_prob(batch)
    ref_c, ref_r = policy.reference().sequence_log_prob(batch)
    loss, _, _ = algos.dpo_loss(c, r, ref_c, ref_r, beta=5000.0)
    torch.testing.assert_close(loss.detach(), torch.full((3,), math.log(2)), atol=1e-4, rtol=0)


@pytest.mark.parametrize("uncond_grad", [None, False])
def test_the_image_scripts_load_a_flux_folder_with_their_knobs(tokenizer_dir, tmp_path, uncond_grad):
    """``recipe.load_policy`` (grpo_image / ddpo_aesthetic's hub route, the flux.1-dev-pickscore preset's knobs)
    detects FLUX from model_index.json and builds the flow policy with FLUX's adapter; --cfg_uncond_grad is accepted (FLUX has no CFG)."""
    from diffusers import FluxPipeline

    from unialign.recipes.image import ImageRLConfig, load_policy

    FluxPipeline(**flux_components(tokenizer_dir)).save_pretrained(str(tmp_path / "flux"))
    cfg = ImageRLConfig(model_name_or_path=str(tmp_path / "flux"), num_steps=3, guidance_scale=3.5, resolution=16,
                        max_sequence_length=T5_TOKENS, lora_rank=2, lora_alpha=4.0, sde_window_size=2,
                        sde_window_range="0,3", cfg_uncond_grad=uncond_grad, torch_dtype="float32")
    policy = load_policy(cfg)
    assert isinstance(policy.family, FluxFamily) and policy.sde_window_size == 2 and policy.lora_rank == 2
    traj = policy.sample(["a cat"], generator=torch.Generator().manual_seed(0))
    assert traj.mask_B_T.sum() == 2 and torch.isfinite(traj.old_logp_B_T).all()
