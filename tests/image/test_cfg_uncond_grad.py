"""``cfg_uncond_grad``: classifier-free guidance in training with the unconditional branch under no_grad
(Flow-GRPO's layout) gives the same guided prediction and the gradient of u + w (c - u) with u a constant;
the default for the DDIM policy keeps DDPO's gradient through both branches."""

from __future__ import annotations

import pytest
import torch

from tests.image.test_flow_policy import make_flow_policy  # noqa: F401  (fixture)


def _grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _by_hand(predict_one, w, x, t, cond, uncond):
    """u (no grad) + w (c - u), each branch its own call: the reference for the detached layout."""
    with torch.no_grad():
        u = predict_one(x, t, uncond)
    c = predict_one(x, t, cond)
    return u + w * (c - u)


def test_ddim_policy_detached_uncond_is_the_guided_value_with_u_constant(make_policy):
    policy = make_policy("sd", guidance_scale=3.0)
    assert policy.cfg_uncond_grad  # DDPO as published
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([901, 501])
    cond = policy.encode_prompts(["a cat", "a dog"])
    unet = policy.unet
    both = policy._denoise(unet, x, t, cond, cfg=True)
    grads_both = _grads(unet, both.square().sum())
    policy.cfg_uncond_grad = False
    detached = policy._denoise(unet, x, t, cond, cfg=True)
    grads_detached = _grads(unet, detached.square().sum())

    def one(x_, t_, c):
        emb = c["prompt_embeds"].expand(x_.shape[0], -1, -1)
        return unet(x_, t_, encoder_hidden_states=emb).sample

    ref = _by_hand(one, 3.0, x, t, cond, policy._uncond())
    grads_ref = _grads(unet, ref.square().sum())
    torch.testing.assert_close(detached, both, rtol=1e-4, atol=1e-5)  # the same prediction
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads_detached[name], g, rtol=1e-4, atol=1e-6)
    gap = max(float((grads_both[n] - grads_ref[n]).abs().max()) for n in grads_ref)
    assert gap > 1e-3  # the default's gradient also flows through u: a different update
    with torch.no_grad():  # sampling / recomputed log-probs: one doubled batch either way
        torch.testing.assert_close(policy._denoise(unet, x, t, cond, cfg=True), both.detach(), rtol=1e-4, atol=1e-5)


def test_flow_policy_detaches_uncond_by_default_as_flow_grpo(make_flow_policy):  # noqa: F811
    policy = make_flow_policy(guidance_scale=3.0)
    assert not policy.cfg_uncond_grad
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = policy.scheduler.timesteps[:2].clone()
    cond = policy.encode_prompts(["a cat", "a red circle"])
    model = policy.model
    detached = policy._denoise(model, x, t, cond)
    grads = _grads(model, detached.square().sum())

    def one(x_, t_, c):
        return model(hidden_states=x_, timestep=t_, encoder_hidden_states=c["prompt_embeds"].expand(2, -1, -1),
                     pooled_projections=c["pooled_prompt_embeds"].expand(2, -1), return_dict=False)[0]

    ref = _by_hand(one, 3.0, x, t, cond, policy._uncond())
    grads_ref = _grads(model, ref.square().sum())
    torch.testing.assert_close(detached, ref, rtol=1e-4, atol=1e-5)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("flag", [True, False])
def test_ratio_one_either_way(make_policy, flag):
    policy = make_policy("sd", guidance_scale=3.0, cfg_uncond_grad=flag)
    traj = policy.sample(["a cat", "a dog"], generator=torch.Generator().manual_seed(1))
    logp = policy.log_prob(traj)  # gradients on, as in training
    torch.testing.assert_close(logp.detach() * traj.mask_B_T, traj.old_logp_B_T * traj.mask_B_T, rtol=1e-4, atol=1e-4)
