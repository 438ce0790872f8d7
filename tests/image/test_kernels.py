"""The step kernels alone, on a stand-in family (no UNet, no transformer, no VAE): a kernel reads only the few
family members its module docstring names, so a linear 'denoiser' is enough to check sampling, ratio 1 on the
recorded steps, the trained-steps masks, the entropy and the closed-form KL."""

from __future__ import annotations

import pytest
import torch

from unialign.image.kernels import DDIMKernel, FlowSDEKernel


class LinearFamily:
    """A family whose denoiser output is ``a * x + b * t / 1000`` (``a`` the model's one weight)."""

    cond_keys = ("prompt_embeds",)
    _cfg = False
    device = torch.device("cpu")

    def __init__(self, scheduler, num_steps: int):
        self.scheduler, self.num_steps = scheduler, num_steps

    def _sampling_cond(self, prompts):
        return {"prompt_embeds": torch.ones(len(prompts), 2, 3)}

    def _initial_latents(self, batch, generator):
        return torch.randn(batch, 4, 4, 4, generator=generator)

    def _denoise(self, model, x, t_B, cond, cfg):
        return model.weight * x + 0.3 * t_B.float().view(-1, 1, 1, 1) / 1000 + 0 * cond["prompt_embeds"].sum()

    def decode(self, latents):
        return [f"image{i}" for i in range(len(latents))]


class Weight(torch.nn.Module):
    def __init__(self, value: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(value))


class Frozen:
    """The reference's interface as the kernels use it (``model`` and ``_frozen()``)."""

    def __init__(self, model):
        self.model = model

    def _frozen(self):
        return torch.no_grad()


def ddim_family(num_steps=6):
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    sched.set_timesteps(num_steps)
    return LinearFamily(sched, num_steps)


def flow_family(num_steps=6):
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(num_steps)
    return LinearFamily(sched, num_steps)


@pytest.mark.parametrize("make", ["ddim", "sde", "sde_window", "cps"])
def test_a_kernel_alone_samples_and_rescores_its_steps(make):
    family = ddim_family() if make == "ddim" else flow_family()
    kernel = {"ddim": lambda: DDIMKernel(family.scheduler, 6, eta=1.0, timestep_fraction=0.5),
              "sde": lambda: FlowSDEKernel(6, 0.7, "sde"),
              "sde_window": lambda: FlowSDEKernel(6, 0.7, "sde", sde_window_size=2, sde_window_range=(0, 4)),
              "cps": lambda: FlowSDEKernel(6, 0.8, "cps")}[make]()
    model = Weight(0.9)
    traj = kernel.sample(family, model, ["a", "b", "c"], torch.Generator().manual_seed(0))
    assert traj.payload["latents"].shape == (3, 7, 4, 4, 4) and traj.completions == ["image0", "image1", "image2"]
    trained = traj.mask_B_T > 0
    expected = {"ddim": 3, "sde": 6, "sde_window": 2, "cps": 5}[make]  # K = 3 of 6; CPS never its last step
    assert (trained.sum(1) == expected).all()
    logp = kernel.log_prob(family, model, traj, False)
    torch.testing.assert_close(logp[trained], traj.old_logp_B_T[trained].float(), atol=1e-5, rtol=0)
    assert (logp[~trained] == 0).all() and logp.requires_grad
    logp, entropy, kl = kernel.log_prob(family, model, traj, True, reference=Frozen(Weight(0.9)))
    assert (kl == 0).all() and (entropy[~trained] == 0).all() and torch.isfinite(entropy).all()
    _, _, kl = kernel.log_prob(family, model, traj, True, reference=Frozen(Weight(0.5)))
    assert (kl[trained] > 0).all() and (kl[~trained] == 0).all()
    kl.sum().backward()
    assert model.weight.grad is not None and model.weight.grad.abs() > 0  # the KL pulls the weight


def test_the_same_generator_gives_the_same_trajectory_and_a_new_one_another():
    family, kernel, model = flow_family(), FlowSDEKernel(6, 0.7, "sde", sde_window_size=2), Weight(0.9)
    a = kernel.sample(family, model, ["a"], torch.Generator().manual_seed(3))
    b = kernel.sample(family, model, ["a"], torch.Generator().manual_seed(3))
    c = kernel.sample(family, model, ["a"], torch.Generator().manual_seed(4))
    assert torch.equal(a.payload["latents"], b.payload["latents"]) and torch.equal(a.mask_B_T, b.mask_B_T)
    assert not torch.equal(a.payload["latents"], c.payload["latents"])


def test_kernel_knobs_are_checked_where_they_are_set():
    family = ddim_family()
    with pytest.raises(ValueError, match="eta must be > 0"):
        DDIMKernel(family.scheduler, 6, eta=0.0)
    with pytest.raises(ValueError, match="timestep_fraction"):
        DDIMKernel(family.scheduler, 6, eta=1.0, timestep_fraction=0.0)
    with pytest.raises(ValueError, match="leaves no trainable step"):
        DDIMKernel(family.scheduler, 6, eta=1.0, min_step_std=10.0)
    with pytest.raises(ValueError):
        FlowSDEKernel(6, 0.7, "sde", sde_window_size=9)
