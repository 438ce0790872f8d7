"""Wan 2.1 text-to-video (``WanFamily`` on ``FlowPolicyBase``) on a tiny random-weight model built in code: a
one-block ``WanTransformer3DModel`` of width 16, a 2-layer ``UMT5EncoderModel``, a 4-channel ``AutoencoderKLWan``
(the stock 8x spatial / 4x temporal factors, per-channel latent statistics) and the conftest's CLIP tokenizer.
Checked against the stock ``WanPipeline``: its latent shape and timesteps, its frames as eta -> 0, the per-channel
decode; ratio 1 on recomputation; a hub folder's UniPC scheduler read as FlowMatchEuler at its flow_shift; the LoRA
through stock ``load_lora_weights``; a saved stock folder loaded by auto-detection; the trainers unchanged with a
per-frame video reward; the hub preset failing fast offline."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from tests.image.conftest import _tokenizer, log_probs_around_a_lora_move
from unialign.image.flow_policy import FlowPolicyBase
from unialign.image.wan import WanFamily

PROMPTS = ["a cat", "a red circle"]
TOKENS = 12
OPTS = dict(num_steps=4, guidance_scale=3.0, noise_level=0.7, max_sequence_length=TOKENS, height=32, width=32,
            num_frames=5)


def wan_components(tokenizer_dir, seed: int = 0, unipc: bool = False) -> dict:
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                           latents_std=[1.5, 0.8, 1.0, 2.0])
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=520, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                                          relative_attention_num_buckets=8)).eval()
    scheduler = (UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
                 if unipc else FlowMatchEulerDiscreteScheduler(shift=3.0))
    return dict(transformer=transformer, vae=vae, text_encoder=encoder, tokenizer=_tokenizer(tokenizer_dir),
                scheduler=scheduler)


@pytest.fixture
def make_wan(tokenizer_dir):
    def factory(seed: int = 0, **kwargs) -> FlowPolicyBase:
        return FlowPolicyBase(**wan_components(tokenizer_dir, seed), family=WanFamily, **{**OPTS, **kwargs})

    return factory


def stock_pipeline(policy):
    from diffusers import WanPipeline

    pipe = WanPipeline(transformer=policy.transformer, vae=policy.vae, text_encoder=policy.text_encoder,
                       tokenizer=policy.tokenizer, scheduler=copy.deepcopy(policy.scheduler))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_table_row_defaults_and_bad_sizes(tokenizer_dir, make_wan):
    from unialign.image.families import FAMILIES, choose_flow_family, family_names, resolve

    policy = make_wan()
    assert FAMILIES["wan"] is WanFamily is resolve("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") is choose_flow_family(
        policy.transformer)
    assert "wan" in family_names() and policy._pipeline_class().__name__ == "WanPipeline"
    assert policy.knobs.num_frames == 5 and policy.sampling_settings()["num_frames"] == 5
    unset = FlowPolicyBase(**wan_components(tokenizer_dir), num_steps=2, family=WanFamily)
    assert (unset.guidance_scale, unset.max_sequence_length, unset.height, unset.width, unset.knobs.num_frames) == (
        5.0, 512, 480, 832, 81)  # WanPipeline's defaults
    with pytest.raises(ValueError, match=r"num_frames must be 4k \+ 1 for Wan 2.1 .*got 6"):
        make_wan(num_frames=6)
    with pytest.raises(ValueError, match=r"multiples of 16 .*got 32 x 40"):
        make_wan(width=40)
    parts = wan_components(tokenizer_dir)
    from diffusers import AutoencoderKL

    parts["vae"] = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    with pytest.raises(ValueError, match="Wan needs its AutoencoderKLWan"):
        FlowPolicyBase(**parts, family=WanFamily, **OPTS)


def test_five_d_latents_timesteps_and_ratio_one(make_wan):
    policy = make_wan(sde_window_size=2, sde_window_range=(0, 3))
    traj = policy.sample(PROMPTS * 2, generator=torch.Generator().manual_seed(1))
    pay = traj.payload
    # x_1 .. x_0 of 5 frames: 1 + (5 - 1) / 4 = 2 latent frames of 32 / 8 = 4 x 4, as WanPipeline.prepare_latents
    assert pay["latents"].shape == (4, 5, 4, 2, 4, 4) and pay["prompt_embeds"].shape == (4, TOKENS, 16)
    assert traj.mask_B_T.sum(1).tolist() == [2.0] * 4
    assert len(traj.completions) == 4 and all(len(video) == 5 for video in traj.completions)
    assert traj.completions[0][0].size == (32, 32) and traj.completions[0][0].mode == "RGB"
    stock = copy.deepcopy(policy.scheduler)
    stock.set_timesteps(4)  # WanPipeline's call
    torch.testing.assert_close(policy.scheduler.timesteps, stock.timesteps, rtol=0, atol=0)
    logp = policy.log_prob(traj)
    trained = traj.mask_B_T > 0
    torch.testing.assert_close(logp[trained], traj.old_logp_B_T[trained], atol=1e-5, rtol=0)
    assert (logp[~trained] == 0).all() and logp.requires_grad


def test_the_hub_folders_unipc_scheduler_becomes_flow_match_euler_at_its_flow_shift(tokenizer_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler

    policy = FlowPolicyBase(**wan_components(tokenizer_dir, unipc=True), family=WanFamily, **OPTS)
    assert type(policy.scheduler) is FlowMatchEulerDiscreteScheduler and policy.scheduler.config.shift == 3.0
    reference = FlowMatchEulerDiscreteScheduler(shift=3.0)
    reference.set_timesteps(4)
    torch.testing.assert_close(policy.scheduler.timesteps, reference.timesteps, rtol=0, atol=0)
    config = dict(wan_components(tokenizer_dir, unipc=True)["scheduler"].config, _class_name="UniPCMultistepScheduler")
    assert WanFamily.flow_scheduler(config).config.shift == 3.0  # a folder's scheduler_config.json


@pytest.mark.parametrize("w", [1.0, 3.0])
def test_small_eta_approaches_the_stock_wan_pipeline(make_wan, w):
    """The stock pipeline's u + g (c - u) is the policy's w (the same convention); w = 1: no CFG."""
    gaps = []
    for eta in (1e-1, 1e-3):
        policy = make_wan(noise_level=eta, guidance_scale=w)
        traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(3))
        stock = stock_pipeline(policy)(PROMPTS, num_inference_steps=4, guidance_scale=w, num_frames=5, height=32,
                                       width=32, latents=traj.payload["latents"][:, 0], output_type="latent",
                                       max_sequence_length=TOKENS).frames
        gaps.append(float((traj.payload["latents"][:, -1] - stock).abs().max()))
    assert gaps[1] < 2e-2 and gaps[1] < gaps[0] / 10, gaps


def test_decode_is_the_stock_pipelines_frames(make_wan):
    policy = make_wan()
    z = torch.randn(2, 4, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    videos = policy.decode(z)
    pipe = stock_pipeline(policy)
    mean = torch.tensor(policy.vae.config.latents_mean).view(1, 4, 1, 1, 1)
    std = 1.0 / torch.tensor(policy.vae.config.latents_std).view(1, 4, 1, 1, 1)
    with torch.no_grad():  # WanPipeline.__call__'s decode, then its VideoProcessor to uint8 frames
        pixels = pipe.vae.decode(z / std + mean, return_dict=False)[0]
    stock = pipe.video_processor.postprocess_video(pixels, output_type="np")  # [B, F, H, W, 3] in [0, 1]
    ours = np.stack([np.stack([np.asarray(f) for f in v]) for v in videos]).astype(np.float32) / 255
    assert ours.shape == stock.shape == (2, 5, 32, 32, 3)
    assert np.abs(ours - stock).max() <= 1 / 255 + 1e-6


def test_lora_reference_save_and_stock_load_lora_weights(make_wan, tokenizer_dir, tmp_path):
    from diffusers import WanPipeline

    policy = make_wan(lora_rank=2)
    ref = policy.reference()
    names = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora" in n for n in names) and any("attn2.to_q" in n for n in names)
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(2))
    before, after, ref_after = log_probs_around_a_lora_move(policy, ref, traj)
    torch.testing.assert_close(ref_after, before, atol=1e-6, rtol=0)
    assert (after - ref_after).abs().max() > 1e-4
    policy.save(str(tmp_path / "lora"))
    assert "frames[0]" in policy.load_snippet(str(tmp_path / "lora"), "Wan-AI/Wan2.1-T2V-1.3B-Diffusers")

    pipe = WanPipeline(**wan_components(tokenizer_dir))  # a fresh copy of the base weights
    pipe.set_progress_bar_config(disable=True)
    base = FlowPolicyBase(**{k: getattr(pipe, k) for k in ("transformer", "vae", "text_encoder", "tokenizer")},
                          scheduler=pipe.scheduler, family=WanFamily, **OPTS)
    x, t = traj.payload["latents"][:, 1], traj.payload["timesteps"][:, 1]
    cond = {"prompt_embeds": traj.payload["prompt_embeds"]}
    with torch.no_grad():
        v_base = base._denoise(base.model, x, t, cond, False)
        pipe.load_lora_weights(str(tmp_path / "lora"))
        v_loaded = base._denoise(base.model, x, t, cond, False)
        v_trained = policy._denoise(policy.model, x, t, cond, False)
    torch.testing.assert_close(v_loaded, v_trained, atol=1e-5, rtol=0)
    assert (v_loaded - v_base).abs().max() > 1e-3


def test_a_saved_stock_folder_loads_by_its_model_index(tokenizer_dir, tmp_path):
    from diffusers import WanPipeline

    from unialign.recipes.image import ImageRLConfig, load_policy

    WanPipeline(**wan_components(tokenizer_dir, unipc=True)).save_pretrained(str(tmp_path / "wan"))
    cfg = ImageRLConfig(model_name_or_path=str(tmp_path / "wan"), num_steps=3, guidance_scale=2.0, resolution=32,
                        num_frames=5, max_sequence_length=TOKENS, lora_rank=2, sde_window_size=2,
                        sde_window_range="0,3", torch_dtype="float32")
    policy = load_policy(cfg)  # model_family auto: model_index.json names WanPipeline
    assert type(policy.family) is WanFamily and policy.lora_rank == 2 and policy.scheduler.config.shift == 3.0
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(policy.log_prob(traj), traj.old_logp_B_T, atol=1e-5, rtol=0)
    full = WanFamily.load(str(tmp_path / "wan"), num_steps=2, max_sequence_length=TOKENS, height=32, width=32,
                          num_frames=5)
    full.save(str(tmp_path / "full"))  # a full fine-tune: a whole stock folder, sampling as the run did
    stock = WanPipeline.from_pretrained(str(tmp_path / "full"))
    assert stock.transformer.config.num_layers == 1 and stock.scheduler.config.shift == 3.0


@pytest.mark.parametrize("algorithm", ["grpo", "awm"])
def test_the_online_trainer_trains_it_unchanged(make_wan, tmp_path, algorithm):
    from unialign.rewards.video import PerFrameReward
    from unialign.trainers import OnlineConfig, OnlineTrainer

    policy = make_wan(lora_rank=2, num_steps=3, sde_window_size=2)
    if algorithm == "awm":  # the forward-process kernel: the velocity-matching surrogate at fresh noise
        policy.use_forward_process(train_timesteps=2, timestep_fraction=1.0)
    cfg = OnlineConfig(algorithm=algorithm, num_generations=2, prompts_per_step=2, micro_batch_size=4, max_steps=1,
                       learning_rate=1e-2, beta=0.0, report_to="none", output_dir=str(tmp_path))

    def brightness(prompts, completions):
        return [float(np.asarray(img, dtype=np.float32).mean() / 255.0) for img in completions]

    trainer = OnlineTrainer(policy, PerFrameReward(brightness, reduction="min"), [{"prompt": p} for p in PROMPTS],
                            cfg)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    history = trainer.train()
    assert math.isfinite(history[0]["loss"])
    assert any(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters() if n in before)


@pytest.mark.slow
def test_grpo_image_trains_a_wan_folder_with_an_image_reward_per_frame(tokenizer_dir, tmp_path):
    """The image script on a video model: an image reward scores every frame (the clip: their mean), the
    comparison is the clips' frames side by side, final/ is the LoRA stock WanPipeline loads."""
    from diffusers import WanPipeline
    from PIL import Image

    from tests.test_scripts import run

    WanPipeline(**wan_components(tokenizer_dir, unipc=True)).save_pretrained(str(tmp_path / "wan"))
    out = tmp_path / "run"
    summary = run("grpo_image", [
        "--model_name_or_path", str(tmp_path / "wan"), "--prompt_set", "animals", "--reward_funcs",
        "jpeg_compressibility", "--frame_reduction", "min", "--num_frames", "5", "--resolution", "32",
        "--max_sequence_length", str(TOKENS), "--num_steps", "3", "--sde_window_range", "0,3", "--max_steps", "1",
        "--num_generations", "2", "--prompts_per_step", "2", "--micro_batch_size", "4", "--num_eval", "4",
        "--lora_rank", "2", "--output_dir", str(out), "--report_to", "none"])
    assert summary["steps"] == 1 and math.isfinite(summary["after"])
    strip = Image.open(summary["comparison_image"])
    assert strip.width > strip.height  # a clip per row pair: five frames side by side
    assert json.loads((out / "final" / "sampling.json").read_text())["num_frames"] == 5
    pipe = WanPipeline.from_pretrained(str(tmp_path / "wan"))
    pipe.load_lora_weights(str(out / "final"))  # the stock loader takes what the run saved


def test_the_reward_and_frame_checks_of_a_video_model(tokenizer_dir, tmp_path):
    from diffusers import WanPipeline

    from tests.test_scripts import load_script
    from unialign.config import UserError, parse_config
    from unialign.recipes.image import build_rewards, check_sampling_knobs, sample_kind

    WanPipeline(**wan_components(tokenizer_dir)).save_pretrained(str(tmp_path / "wan"))
    module = load_script("grpo_image")

    def config(*argv):
        return parse_config(module.GRPOImageConfig, ["--model_name_or_path", str(tmp_path / "wan"),
                                                     "--prompt_set", "animals", *argv])

    assert sample_kind(config()) == "video"
    with pytest.raises(UserError, match="'math_accuracy' scores texts, and this script samples video"):
        module.main(config("--reward_funcs", "math_accuracy"))
    with pytest.raises(ValueError, match="num_frames: the SD3 family makes images; --num_frames is for video "
                                         "families \\(wan\\)"):
        check_sampling_knobs(config("--num_frames", "5"), "sd3")
    # an image reward on a video model: per frame, reduced; a video reward as it is
    cfg = config("--frame_reduction", "min")
    reward = build_rewards(cfg, ["jpeg_compressibility", "temporal_consistency"], None, "video")
    from PIL import Image

    dark = Image.new("RGB", (32, 32), (0, 0, 0))
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    video = [dark, dark, noisy]
    scored = reward(["p"], [video])
    from unialign.rewards import get_reward

    jpeg = get_reward("jpeg_compressibility")(["p"] * 3, video)
    assert scored.per_function["jpeg_compressibility"].tolist() == pytest.approx([min(jpeg)])
    assert 0 < float(scored.per_function["temporal_consistency"][0]) < 1


def test_the_hub_preset_fails_fast_offline(monkeypatch, capsys):
    import time

    from tests.test_scripts import load_script
    from unialign.config import exit_on_user_error, parse_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="Wan-AI/Wan2.1-T2V-1.3B-Diffusers"):
        WanFamily.load("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    module = load_script("grpo_image")
    cfg = parse_config(module.GRPOImageConfig, ["--preset", "wan2.1-t2v-1.3b-pickscore"], presets=module.PRESETS)
    assert (cfg.model_family, cfg.num_frames, cfg.algorithm) == ("wan", 5, "flow_grpo")
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        module.main(cfg)
    assert exit_info.value.code == 2 and "PickScore_v1" in capsys.readouterr().err  # the first download it needs
    assert time.perf_counter() - start < 30  # seconds, not a minute of retries


def test_a_wan_2_2_folder_is_refused_naming_what_differs(tokenizer_dir, tmp_path):
    from diffusers import WanPipeline

    parts = wan_components(tokenizer_dir)
    WanPipeline(**parts, transformer_2=copy.deepcopy(parts["transformer"]), boundary_ratio=0.875).save_pretrained(
        str(tmp_path / "wan22"))
    with pytest.raises(ValueError, match="is a Wan 2.2 pipeline"):
        WanFamily.load(str(tmp_path / "wan22"), num_frames=5, height=32, width=32)
