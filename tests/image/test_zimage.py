"""Z-Image (``ZImageFamily`` on ``FlowPolicyBase``) on a tiny random-weight model built in code: a
``ZImageTransformer2DModel`` of width 32, a 2-layer ``Qwen3Model`` text encoder, the conftest's CLIP tokenizer with
a chat template, the FLUX VAE factors. Checked against the stock ``ZImagePipeline``: its sigmas, its CFG convention
(g = w - 1) and its images as eta -> 0; ratio 1 on recomputation; the LoRA through stock ``load_lora_weights``; a
saved stock folder loaded by auto-detection; the trainers unchanged; the hub preset failing fast offline."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from tests.image.conftest import _tokenizer, log_probs_around_a_lora_move
from unialign.image.flow_policy import FlowPolicyBase
from unialign.image.zimage import ZImageFamily

PROMPTS = ["a cat", "a red circle"]
TOKENS = 12
CHAT = ("{% for m in messages %}<|startoftext|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|endoftext|>{% endif %}")
OPTS = dict(num_steps=4, guidance_scale=3.0, noise_level=0.7, max_sequence_length=TOKENS, height=16, width=16)


def zimage_components(tokenizer_dir, seed: int = 0) -> dict:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32])
    encoder = Qwen3Model(Qwen3Config(vocab_size=520, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8)).eval()
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                        norm_num_groups=4, layers_per_block=1, sample_size=16, scaling_factor=0.3611,
                        shift_factor=0.1159)
    tokenizer = _tokenizer(tokenizer_dir)
    tokenizer.chat_template = CHAT
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    return dict(transformer=transformer, vae=vae, text_encoder=encoder, tokenizer=tokenizer, scheduler=scheduler)


@pytest.fixture
def make_zimage(tokenizer_dir):
    def factory(seed: int = 0, **kwargs) -> FlowPolicyBase:
        return FlowPolicyBase(**zimage_components(tokenizer_dir, seed), family=ZImageFamily, **{**OPTS, **kwargs})

    return factory


def stock_pipeline(policy):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline(transformer=policy.transformer, vae=policy.vae, text_encoder=policy.text_encoder,
                          tokenizer=policy.tokenizer, scheduler=copy.deepcopy(policy.scheduler))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_table_row_and_the_defaults_are_the_pipelines(tokenizer_dir, make_zimage):
    from unialign.image.families import FAMILIES, choose_flow_family, resolve

    policy = make_zimage()
    assert FAMILIES["zimage"] is ZImageFamily is resolve("Tongyi-MAI/Z-Image") is choose_flow_family(policy.transformer)
    assert type(policy.family) is ZImageFamily and policy.text_encoder_2 is None
    assert policy._pipeline_class().__name__ == "ZImagePipeline"
    unset = FlowPolicyBase(**zimage_components(tokenizer_dir), num_steps=2, family=ZImageFamily)
    assert (unset.guidance_scale, unset.max_sequence_length, unset.height) == (6.0, 512, 1024)  # g = 5 is w = 6
    with pytest.raises(ValueError, match="Z-Image takes the text parts text_encoder, tokenizer; text_encoder_2"):
        FlowPolicyBase(**zimage_components(tokenizer_dir), text_encoder_2=policy.text_encoder, family=ZImageFamily,
                       **OPTS)
    parts = zimage_components(tokenizer_dir)
    parts["tokenizer"].chat_template = None
    with pytest.raises(ValueError, match="needs a chat template"):
        ZImageFamily.policy_class()(**parts, family=ZImageFamily, **OPTS)
    with pytest.raises(ValueError, match=r"multiples of 4 .*got 16 x 18"):
        FlowPolicyBase(**zimage_components(tokenizer_dir), family=ZImageFamily, **{**OPTS, "width": 18})


def test_sample_sigmas_and_ratio_one_against_the_stock_velocity(make_zimage):
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, retrieve_timesteps

    policy = make_zimage(sde_window_size=2, sde_window_range=(0, 3))
    traj = policy.sample(PROMPTS * 2, generator=torch.Generator().manual_seed(1))
    pay = traj.payload
    assert pay["latents"].shape == (4, 5, 4, 8, 8) and pay["prompt_embeds"].shape == (4, TOKENS, 16)
    assert pay["prompt_mask"].dtype == torch.bool and traj.mask_B_T.sum(1).tolist() == [2.0] * 4
    # each prompt's real tokens: the chat-templated text, then the padding masked out and zeroed
    assert 0 < int(pay["prompt_mask"][0].sum()) < TOKENS and (pay["prompt_embeds"][~pay["prompt_mask"]] == 0).all()
    stock = copy.deepcopy(policy.scheduler)
    retrieve_timesteps(stock, 4, "cpu", sigmas=torch.linspace(1.0, 1 / 4, 4).tolist(),
                       mu=calculate_shift(16, 256, 4096, 0.5, 1.15))  # ZImagePipeline's, 16 image tokens
    torch.testing.assert_close(policy.scheduler.timesteps, stock.timesteps, rtol=0, atol=0)

    logp = policy.log_prob(traj)
    trained = traj.mask_B_T > 0
    torch.testing.assert_close(logp[trained], traj.old_logp_B_T[trained], atol=1e-5, rtol=0)
    assert (logp[~trained] == 0).all() and logp.requires_grad


@pytest.mark.parametrize("w", [1.0, 3.0])
def test_small_eta_approaches_the_stock_zimage_pipeline(make_zimage, w):
    """w = 1: no CFG (the stock g = 0, Z-Image-Turbo's); w = 3: the stock g = 2, c + 2 (c - u)."""
    gaps = []
    for eta in (1e-1, 1e-3):
        policy = make_zimage(noise_level=eta, guidance_scale=w)
        traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(3))
        stock = stock_pipeline(policy)(PROMPTS, num_inference_steps=4, guidance_scale=w - 1,
                                       latents=traj.payload["latents"][:, 0], output_type="latent",
                                       max_sequence_length=TOKENS, height=16, width=16).images
        gaps.append(float((traj.payload["latents"][:, -1] - stock).abs().max()))
    assert gaps[1] < 1e-2 and gaps[1] < gaps[0] / 10, gaps


def test_lora_reference_save_and_stock_load_lora_weights(make_zimage, tokenizer_dir, tmp_path):
    from diffusers import ZImagePipeline

    policy = make_zimage(lora_rank=2)
    ref = policy.reference()
    names = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora" in n for n in names) and any("attention.to_q" in n for n in names)
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(2))
    before, after, ref_after = log_probs_around_a_lora_move(policy, ref, traj)
    torch.testing.assert_close(ref_after, before, atol=1e-6, rtol=0)
    assert (after - ref_after).abs().max() > 1e-4
    policy.save(str(tmp_path / "lora"))

    pipe = ZImagePipeline(**zimage_components(tokenizer_dir))  # a fresh copy of the base weights
    pipe.set_progress_bar_config(disable=True)
    base = FlowPolicyBase(**{k: getattr(pipe, k) for k in ("transformer", "vae", "text_encoder", "tokenizer")},
                          scheduler=pipe.scheduler, family=ZImageFamily, **OPTS)
    x, t = traj.payload["latents"][:, 1], traj.payload["timesteps"][:, 1]
    cond = {k: traj.payload[k] for k in ("prompt_embeds", "prompt_mask")}
    with torch.no_grad():
        v_base = base._denoise(base.model, x, t, cond, False)
        pipe.load_lora_weights(str(tmp_path / "lora"))
        v_loaded = base._denoise(base.model, x, t, cond, False)
        v_trained = policy._denoise(policy.model, x, t, cond, False)
    torch.testing.assert_close(v_loaded, v_trained, atol=1e-5, rtol=0)
    assert (v_loaded - v_base).abs().max() > 1e-3


def test_a_saved_stock_folder_loads_by_its_model_index(tokenizer_dir, tmp_path):
    from diffusers import ZImagePipeline

    from unialign.recipes.image import ImageRLConfig, load_policy

    ZImagePipeline(**zimage_components(tokenizer_dir)).save_pretrained(str(tmp_path / "zimage"))
    cfg = ImageRLConfig(model_name_or_path=str(tmp_path / "zimage"), num_steps=3, guidance_scale=2.0, resolution=16,
                        max_sequence_length=TOKENS, lora_rank=2, sde_window_size=2, sde_window_range="0,3",
                        torch_dtype="float32")
    policy = load_policy(cfg)  # model_family auto: model_index.json names ZImagePipeline
    assert type(policy.family) is ZImageFamily and policy.lora_rank == 2 and policy.tokenizer.chat_template == CHAT
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(policy.log_prob(traj), traj.old_logp_B_T, atol=1e-5, rtol=0)
    full = ZImageFamily.load(str(tmp_path / "zimage"), num_steps=2, max_sequence_length=TOKENS, height=16, width=16)
    full.save(str(tmp_path / "full"))  # a full fine-tune: a whole stock folder
    assert ZImagePipeline.from_pretrained(str(tmp_path / "full")).transformer.config.dim == 32


@pytest.mark.parametrize("algorithm", ["grpo", "awm"])
def test_the_online_trainer_trains_it_unchanged(make_zimage, tmp_path, algorithm):
    from unialign.trainers import OnlineConfig, OnlineTrainer

    policy = make_zimage(lora_rank=2, num_steps=3, sde_window_size=2)
    if algorithm == "awm":  # the forward-process kernel: the velocity-matching surrogate at fresh noise
        policy.use_forward_process(train_timesteps=2, timestep_fraction=1.0)
    cfg = OnlineConfig(algorithm=algorithm, num_generations=2, prompts_per_step=2, micro_batch_size=4, max_steps=1,
                       learning_rate=1e-2, beta=0.0, report_to="none", output_dir=str(tmp_path))

    def brightness(prompts, completions):
        return [float(np.asarray(img, dtype=np.float32).mean() / 255.0) for img in completions]

    trainer = OnlineTrainer(policy, brightness, [{"prompt": p} for p in PROMPTS], cfg)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    history = trainer.train()
    assert math.isfinite(history[0]["loss"])
    assert any(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters() if n in before)


def test_the_hub_preset_fails_fast_offline(monkeypatch, capsys):
    import time

    from tests.test_scripts import load_script
    from unialign.config import exit_on_user_error, parse_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="Tongyi-MAI/Z-Image-Turbo"):
        ZImageFamily.load("Tongyi-MAI/Z-Image-Turbo")
    module = load_script("grpo_image")
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        module.main(parse_config(module.GRPOImageConfig, ["--preset", "z-image-turbo-pickscore"],
                                 presets=module.PRESETS))
    assert exit_info.value.code == 2 and "PickScore_v1" in capsys.readouterr().err
    assert time.perf_counter() - start < 30  # seconds, not a minute of retries
