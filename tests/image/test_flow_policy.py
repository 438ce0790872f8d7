"""``FlowMatchingPolicy`` (SD3 family) on a tiny random-weight SD3 pipeline built in code: trajectory
shapes and the SDE window, ratio 1, the step kernel, the reference, one GRPO trainer step, and eta -> 0
against the stock ``StableDiffusion3Pipeline``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.image.conftest import _text_config, _tokenizer, _vae, colour_pairs
from unialign.image.flow import sde_step_with_logprob
from unialign.image.flow_policy import FlowMatchingPolicy
from unialign.trainers import OnlineConfig, OnlineTrainer

PROMPTS = ["a cat", "a red circle"]
T5_TOKENS = 4  # length of the zero block standing in for T5 (text_encoder_3=None, as the stock pipeline)


def sd3_components(tokenizer_dir, seed: int = 0) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(  # CLIP hidden 16 + 16 = joint 32; pooled 16 + 16 = 32
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, out_channels=4, pos_embed_max_size=8,
    )
    return dict(transformer=transformer, vae=_vae(),
                text_encoder=CLIPTextModelWithProjection(_text_config(16, projection=16)).eval(),
                tokenizer=_tokenizer(tokenizer_dir),
                text_encoder_2=CLIPTextModelWithProjection(_text_config(16, projection=16)).eval(),
                tokenizer_2=_tokenizer(tokenizer_dir), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


@pytest.fixture
def make_flow_policy(tokenizer_dir):
    def factory(seed: int = 0, **kwargs) -> FlowMatchingPolicy:
        opts = dict(num_steps=4, guidance_scale=3.0, noise_level=0.7, max_sequence_length=T5_TOKENS)
        return FlowMatchingPolicy(**sd3_components(tokenizer_dir, seed), **{**opts, **kwargs})

    return factory


def test_sample_records_the_window(make_flow_policy):
    policy = make_flow_policy(num_steps=6, sde_window_size=2, sde_window_range=(1, 5))
    traj = policy.sample(PROMPTS * 2, generator=torch.Generator().manual_seed(0))
    b, n = 4, 6
    assert traj.payload["latents"].shape == (b, n + 1, 4, 8, 8) and traj.payload["latents"].dtype == torch.float32
    assert traj.payload["timesteps"].shape == (b, n)
    assert traj.payload["prompt_embeds"].shape == (b, 8 + T5_TOKENS, 32)
    assert traj.payload["pooled_prompt_embeds"].shape == (b, 32)
    assert traj.mask_B_T.shape == traj.old_logp_B_T.shape == (b, n) and len(traj.completions) == b
    assert traj.completions[0].size == (16, 16)
    cols = traj.mask_B_T[0].nonzero().flatten().tolist()
    assert len(cols) == 2 and cols[1] == cols[0] + 1 and 1 <= cols[0] <= 3
    assert torch.equal(traj.mask_B_T, traj.mask_B_T[:1].expand(b, -1))  # one window for the batch
    assert torch.isfinite(traj.old_logp_B_T).all()
    assert (traj.old_logp_B_T[traj.mask_B_T == 0] == 0).all() and (traj.old_logp_B_T[traj.mask_B_T > 0] != 0).all()
    windows = {tuple(policy.sample(PROMPTS[:1], generator=torch.Generator().manual_seed(s)).mask_B_T[0].tolist())
               for s in range(12)}
    assert len(windows) > 1  # the window moves with the generator
    full = make_flow_policy().sample(PROMPTS, generator=torch.Generator().manual_seed(0))
    assert (full.mask_B_T == 1).all()


def test_the_deterministic_last_cps_step_is_never_trained(make_flow_policy):
    """CPS's last step has std sigma' sin(eta pi / 2) = 0: no Gaussian, so mask 0 there (Flow-GRPO never trains
    its last step), and the closed-form KL over the trained steps is finite where it would refuse that step."""
    cps = make_flow_policy(sde_type="cps", noise_level=0.8, num_steps=4)
    traj = cps.sample(PROMPTS, generator=torch.Generator().manual_seed(0))
    assert traj.mask_B_T[:, :3].eq(1).all() and traj.mask_B_T[:, 3].eq(0).all()
    cps.reference()
    with torch.no_grad():
        for p in cps.trainable_parameters():
            p.add_(0.01 * torch.randn_like(p))
    _, entropy, kl = cps.log_prob_and_kl(traj)
    assert torch.isfinite(kl).all() and (kl[:, :3] > 0).all() and (kl[:, 3] == 0).all() and (entropy[:, 3] == 0).all()
    sde = make_flow_policy(num_steps=4).sample(PROMPTS, generator=torch.Generator().manual_seed(0))
    assert sde.mask_B_T.eq(1).all()  # every "sde" step has std > 0


@pytest.mark.parametrize("sde_type,guidance", [("sde", 3.0), ("sde", 1.0), ("cps", 3.0), ("cps", 1.0)])
def test_ratio_one_and_the_step_kernel(make_flow_policy, sde_type, guidance):
    noise = 0.7 if sde_type == "sde" else 0.8
    policy = make_flow_policy(sde_type=sde_type, guidance_scale=guidance, noise_level=noise,
                              sde_window_size=2, sde_window_range=(0, 3))
    traj = policy.sample(PROMPTS * 2, generator=torch.Generator().manual_seed(1))
    logp = policy.log_prob(traj)
    trained = traj.mask_B_T > 0
    assert logp.requires_grad
    torch.testing.assert_close(logp[trained], traj.old_logp_B_T[trained], atol=1e-5, rtol=0)
    assert (logp[~trained] == 0).all()

    # the kernel called directly on one recorded step, with an independent CFG velocity
    i = int(trained[0].nonzero()[0])
    lat, t = traj.payload["latents"], traj.payload["timesteps"][:, i]
    embeds, pooled = traj.payload["prompt_embeds"], traj.payload["pooled_prompt_embeds"]
    with torch.no_grad():
        def velocity(emb, pool):
            return policy.transformer(hidden_states=lat[:, i], timestep=t, encoder_hidden_states=emb,
                                      pooled_projections=pool).sample

        v = velocity(embeds, pooled)
        if guidance > 1:
            u = policy.encode_prompts([""] * len(traj))
            v_u = velocity(u["prompt_embeds"], u["pooled_prompt_embeds"])
            v = v_u + guidance * (v - v_u)
        _, kernel_logp, _, _ = sde_step_with_logprob(policy.scheduler, v, t, lat[:, i], noise,
                                                     prev_sample=lat[:, i + 1], sde_type=sde_type)
    torch.testing.assert_close(logp[:, i].detach(), kernel_logp, atol=1e-5, rtol=0)
    # an untrained step is the deterministic Euler step x + v dt
    j = int((~trained[0]).nonzero()[-1])
    with torch.no_grad():
        v = policy._denoise(policy.transformer, lat[:, j], traj.payload["timesteps"][:, j],
                            {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled})
    sigmas = policy.scheduler.sigmas
    torch.testing.assert_close(lat[:, j + 1], lat[:, j] + (sigmas[j + 1] - sigmas[j]) * v, atol=1e-5, rtol=0)
    _, entropy = policy.log_prob_and_entropy(traj)
    assert (entropy[~trained] == 0).all() and torch.isfinite(entropy).all()


def test_reference_is_the_policy_without_adapters(make_flow_policy, tokenizer_dir, tmp_path):
    policy = make_flow_policy(lora_rank=2)
    ref = policy.reference()
    assert all("lora" in n for n, p in policy.transformer.named_parameters() if p.requires_grad)
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before, ref_before = policy.log_prob(traj), ref.log_prob(traj)
    torch.testing.assert_close(before, ref_before, atol=1e-6, rtol=0)  # lora_B starts at 0
    with torch.no_grad():
        lora_b = next(p for n, p in policy.transformer.named_parameters() if "lora_B" in n)
        lora_b.add_(0.5)
        after, ref_after = policy.log_prob(traj), ref.log_prob(traj)
        _, _, kl = policy.log_prob_and_kl(traj)
    torch.testing.assert_close(ref_after, ref_before, atol=1e-6, rtol=0)
    assert (after - ref_after).abs().max() > 1e-4 and (kl > 0).all()
    policy.save(str(tmp_path / "lora"))
    from safetensors.torch import load_file

    keys = list(load_file(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.") for k in keys)
    # the stock loader on a fresh copy of the base weights reproduces the trained transformer
    from diffusers import StableDiffusion3Pipeline

    parts = sd3_components(tokenizer_dir)
    pipe = StableDiffusion3Pipeline(**parts, text_encoder_3=None, tokenizer_3=None)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    x, t = traj.payload["latents"][:, 1], traj.payload["timesteps"][:, 1]
    cond = dict(encoder_hidden_states=traj.payload["prompt_embeds"],
                pooled_projections=traj.payload["pooled_prompt_embeds"])
    with torch.no_grad():
        torch.testing.assert_close(pipe.transformer(hidden_states=x, timestep=t, **cond).sample,
                                   policy.transformer(hidden_states=x, timestep=t, **cond).sample, atol=1e-5, rtol=0)


def test_one_grpo_step_changes_the_weights(make_flow_policy, tmp_path):
    policy = make_flow_policy(lora_rank=2, sde_window_size=2)
    brightness = lambda prompts, completions: [float(np.asarray(im).mean() / 255) for im in completions]  # noqa: E731
    cfg = OnlineConfig(algorithm="grpo", num_generations=2, prompts_per_step=2, micro_batch_size=4, max_steps=1,
                       learning_rate=1e-2, beta=0.0, report_to="none", output_dir=str(tmp_path))
    trainer = OnlineTrainer(policy, brightness, [{"prompt": p} for p in PROMPTS], cfg)
    before = {n: p.detach().clone() for n, p in policy.transformer.named_parameters() if p.requires_grad}
    history = trainer.train()  # includes the ratio-1 self-check on the first update
    assert trainer.ratio_checked and len(history) == 1 and np.isfinite(history[0]["reward/mean"])
    moved = [n for n, p in policy.transformer.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved


def test_chunked_grpo_update_with_gaussian_kl_gives_the_whole_gradients(make_flow_policy, tmp_path):
    policy = make_flow_policy(lora_rank=2, num_steps=3)
    with torch.no_grad():
        for n, p in policy.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # policy != reference, so the KL term has a gradient
    brightness = lambda prompts, completions: [float(np.asarray(im).mean() / 255) for im in completions]  # noqa: E731
    cfg = OnlineConfig(algorithm="grpo", num_generations=2, prompts_per_step=2, micro_batch_size=4, max_steps=1,
                       learning_rate=1e-3, beta=0.04, kl_estimator="gaussian", report_to="none",
                       output_dir=str(tmp_path))
    trainer = OnlineTrainer(policy, brightness, [{"prompt": p} for p in PROMPTS], cfg)
    traj, _ = trainer.collect()
    traj.advantages_B_T = torch.linspace(-1, 1, traj.mask_B_T.numel()).view_as(traj.mask_B_T)
    grads = []
    for chunk in (0, 5):  # 12 trained pairs: one call, or chunks of 5, 5, 2
        policy.train_chunk_size = chunk
        assert len(policy.step_chunks(traj.mask_B_T)) == (1 if chunk == 0 else 3)
        captured = {}
        trainer.optimizer.step = lambda out=captured: out.update(
            {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None})
        trainer.update(traj)
        grads.append(captured)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-12)
    assert any(float(g.abs().max()) > 0 for g in grads[0].values())


def test_small_eta_approaches_the_stock_pipelines_euler_sampling(make_flow_policy):
    from diffusers import StableDiffusion3Pipeline

    gaps = []
    for eta in (1e-1, 1e-3):
        policy = make_flow_policy(noise_level=eta)
        traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(3))
        pipe = StableDiffusion3Pipeline(transformer=policy.transformer, vae=policy.vae, scheduler=policy.scheduler,
                                        text_encoder=policy.text_encoder, tokenizer=policy.tokenizer,
                                        text_encoder_2=policy.text_encoder_2, tokenizer_2=policy.tokenizer_2,
                                        text_encoder_3=None, tokenizer_3=None)
        pipe.set_progress_bar_config(disable=True)
        x1 = traj.payload["latents"][:, 0]
        stock = pipe(PROMPTS, num_inference_steps=4, guidance_scale=3.0, latents=x1.clone(), output_type="latent",
                     max_sequence_length=T5_TOKENS, height=16, width=16).images
        gaps.append(float((traj.payload["latents"][:, -1] - stock).abs().max()))
    assert gaps[1] < 1e-2 and gaps[1] < gaps[0] / 10, gaps


def test_from_pretrained_loads_a_stock_sd3_folder(tokenizer_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    StableDiffusion3Pipeline(**sd3_components(tokenizer_dir), text_encoder_3=None, tokenizer_3=None).save_pretrained(
        str(tmp_path / "sd3"))
    policy = FlowMatchingPolicy.from_pretrained(str(tmp_path / "sd3"), lora_rank=2, num_steps=3,
                                                max_sequence_length=T5_TOKENS)
    assert policy.text_encoder_3 is None and policy.scheduler.config.shift == 3.0
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(policy.log_prob(traj), traj.old_logp_B_T, atol=1e-5, rtol=0)


def test_bad_window_and_offline_load_fail_clearly(make_flow_policy, monkeypatch):
    with pytest.raises(ValueError, match="sde_window_size"):
        make_flow_policy(sde_window_size=5)
    with pytest.raises(ValueError, match=r"multiples of 4 .*got 18 x 16"):  # VAE factor 2 x patch 2
        make_flow_policy(height=18, width=16)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(Exception, match="stabilityai/not-a-real-sd3"):
        FlowMatchingPolicy.from_pretrained("stabilityai/not-a-real-sd3")


def dpo_pairs(n: int = 3) -> list[dict]:
    return colour_pairs(PROMPTS, n)


def test_dpo_surrogate_against_a_hand_restatement(make_flow_policy):
    policy = make_flow_policy()  # guidance 3.0: the surrogate must still run without CFG
    batch = policy.preference_batch(dpo_pairs())
    pay = batch.payload
    assert pay["timesteps"].shape == pay["sigmas"].shape == (3,) and pay["noise"].shape == (3, 4, 8, 8)
    # uniform over the scheduler's 1000 training timesteps, shifted by shift=3 (SD3: no dynamic shifting)
    u = torch.arange(1000, 0, -1, dtype=torch.float64) / 1000
    table = 3.0 * u / (1 + 2.0 * u)
    assert all(bool(((table - s).abs() < 1e-6).any()) for s in pay["sigmas"].double())
    torch.testing.assert_close(pay["timesteps"], pay["sigmas"] * 1000)
    chosen, rejected = policy.sequence_log_prob(batch)
    assert chosen.requires_grad and chosen.shape == rejected.shape == (3,)
    s = pay["sigmas"].view(-1, 1, 1, 1)
    for side, got in ((batch.chosen, chosen), (batch.rejected, rejected)):
        x0 = side["latents"]
        with torch.no_grad():
            v = policy.transformer(hidden_states=(1 - s) * x0 + s * pay["noise"], timestep=pay["timesteps"],
                                   encoder_hidden_states=pay["prompt_embeds"],
                                   pooled_projections=pay["pooled_prompt_embeds"]).sample
        torch.testing.assert_close(got.detach(), -0.5 * ((v - (pay["noise"] - x0)) ** 2).mean(dim=(1, 2, 3)),
                                   atol=1e-6, rtol=1e-5)


def test_dpo_identical_pair_gives_ln2_and_caption_dropout(make_flow_policy):
    import math

    from unialign import algos

    policy = make_flow_policy(lora_rank=2, caption_dropout=1.0)
    policy.transformer.eval()
    batch = policy.preference_batch(dpo_pairs())
    assert batch.prompts == [p["prompt"] for p in dpo_pairs()]  # eval mode: no dropout
    batch.rejected = dict(batch.chosen)
    c, r = policy.sequence_log_prob(batch)
    ref_c, ref_r = policy.reference().sequence_log_prob(batch)
    loss, _, _ = algos.dpo_loss(c, r, ref_c, ref_r, beta=5000.0)
    torch.testing.assert_close(loss.detach(), torch.full((3,), math.log(2)), atol=1e-4, rtol=0)
    policy.transformer.train()
    assert policy.preference_batch(dpo_pairs()).prompts == [""] * 3


def test_flow_grpo_preset_regularises_at_the_papers_strength(make_flow_policy, tmp_path):
    """The worked example: on a tiny SD3 policy with LoRA moved off the reference, the KL term the trainer adds for
    ``--algorithm flow_grpo`` equals beta * Flow-GRPO's own KL, restated here from its train_sd3.py (yifan123/
    flow_grpo): ``((mu - mu_ref) ** 2).mean(CHW) / (2 * std_dev_t ** 2)`` with std_dev_t = g = eta sqrt(sigma /
    (1 - sigma)) (sigma = 1 -> sigmas[1]) and mu = x (1 + g^2 dt / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) dt,
    beta 0.04 -- and the exact step KL ('gaussian') is that divided by |dt|, ~10x stronger at 10 steps."""
    from unialign import algos
    from unialign.registry import get_algorithm

    spec = get_algorithm("flow_grpo")
    policy = make_flow_policy(lora_rank=2, num_steps=10, guidance_scale=1.0)
    policy.reference()
    with torch.no_grad():
        for n, p in policy.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, _, exact = policy.log_prob_and_kl(traj)
        ours = spec.beta * algos.closed_form_kl(exact, spec.kl_estimator, policy.kl_weights(traj))

    lat, ts = traj.payload["latents"].double(), traj.payload["timesteps"]
    cond = dict(encoder_hidden_states=traj.payload["prompt_embeds"], pooled_projections=traj.payload["pooled_prompt_embeds"])
    sigmas = policy.scheduler.sigmas.double()
    want = torch.zeros(len(traj), 10, dtype=torch.float64)
    for i in range(10):
        x, t = lat[:, i], ts[:, i]
        with torch.no_grad():
            v = policy.transformer(hidden_states=x.float(), timestep=t, **cond).sample.double()
            with policy._adapters_disabled():  # the reference: LoRA off, as Flow-GRPO's disable_adapter()
                v_ref = policy.transformer(hidden_states=x.float(), timestep=t, **cond).sample.double()
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        dt = sigma_next - sigma
        g = 0.7 * torch.sqrt(sigma / (1 - (sigmas[1] if sigma == 1 else sigma)))

        x_coef, v_coef = 1 + g**2 / (2 * sigma) * dt, (1 + g**2 * (1 - sigma) / (2 * sigma)) * dt
        mu, mu_ref = x * x_coef + v * v_coef, x * x_coef + v_ref * v_coef
        want[:, i] = 0.04 * ((mu - mu_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * g**2)
    assert float(want.min()) > 0
    torch.testing.assert_close(ours.double(), want, rtol=1e-3, atol=1e-12)
    dts = (sigmas[:10] - sigmas[1:11]).abs()
    torch.testing.assert_close((spec.beta * exact).double() * dts, want, rtol=1e-3, atol=1e-12)
    assert float((spec.beta * exact).sum() / want.sum()) > 5  # 'gaussian' at beta 0.04: several times the paper's


def test_gaussian_g2_is_refused_for_a_policy_without_kl_weights(make_policy, tmp_path):
    policy = make_policy()
    cfg = OnlineConfig(algorithm="grpo", beta=0.1, kl_estimator="gaussian_g2", report_to="none",
                       output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="gaussian_g2.*offers the closed forms \\[.gaussian.\\]"):
        OnlineTrainer(policy, lambda prompts, completions: [0.0] * len(completions), [{"prompt": "a cat"}], cfg)


@pytest.mark.parametrize("script,preset,beta,estimator", [
    ("grpo_image", "sd3.5-medium-geneval", 0.04, "gaussian_g2"),  # Flow-GRPO config/grpo.py: GenEval beta 0.04
    ("grpo_image", "flux.1-dev-pickscore", 0.01, "gaussian_g2"),  # PickScore beta 0.01
    ("ddpo_aesthetic", "sd15-aesthetic", 0.0, None),              # DDPO: no KL
])
def test_image_presets_resolve_to_their_papers_kl(script, preset, beta, estimator):
    from tests.test_scripts import load_script
    from unialign.config import parse_config

    module = load_script(script)
    cls = next(v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
               and v.__module__ == module.__name__)
    spec = parse_config(cls, ["--preset", preset], presets=module.PRESETS).algo_spec()
    assert spec.beta == beta and (estimator is None or spec.kl_estimator == estimator)
