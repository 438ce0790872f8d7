"""The policy seam (unialign/policy.py): what a trainer asks of a policy in one call, ``loss_forward``, and the
capability protocols a policy declares; the trainers ask, never probe."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import unialign.policy as seam
from unialign.policy import ClosedFormKL, Critic, KLWeights, LossRequest, PolicyBase, SamplingCopy, StepChunks
from unialign.types import Trajectory

ROOT = Path(__file__).resolve().parents[1]
CAPABILITIES = [v for v in vars(seam).values() if isinstance(v, type) and getattr(v, "_is_protocol", False)
                and v.__module__ == seam.__name__ and v is not seam.Policy]


def _trajectory(b=2, t=3) -> Trajectory:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])[:b, :t]
    return Trajectory(prompts=["a"] * b, completions=["x"] * b, mask_B_T=mask, old_logp_B_T=torch.zeros(b, t),
                      truncated_B=torch.zeros(b, dtype=torch.bool))


class Plain(PolicyBase):
    """A policy with log-probs and entropy only."""

    def log_prob_and_entropy(self, trajectory):
        return -trajectory.mask_B_T, 0.5 * trajectory.mask_B_T


class Gaussian(Plain, ClosedFormKL, KLWeights):
    closed_form_kls = ("gaussian", "gaussian_g2")

    def log_prob_and_kl(self, trajectory):
        logp, entropy = self.log_prob_and_entropy(trajectory)
        return logp, entropy, 2.0 * trajectory.mask_B_T

    def kl_weights(self, trajectory):
        return torch.full_like(trajectory.mask_B_T, 0.25)


class WithValues(Plain, Critic):
    has_critic = True

    def log_prob_and_values(self, trajectory):
        logp, entropy = self.log_prob_and_entropy(trajectory)
        return logp, entropy, 3.0 * trajectory.mask_B_T


def test_loss_forward_answers_each_request_from_the_declared_capabilities():
    traj = _trajectory()
    out = Plain().loss_forward(traj, LossRequest())
    assert torch.equal(out.logp_B_T, -traj.mask_B_T) and out.values_B_T is None and out.kl_B_T is None
    assert out.terms == {}
    assert torch.equal(WithValues().loss_forward(traj, LossRequest(values=True)).values_B_T, 3.0 * traj.mask_B_T)
    assert torch.equal(Gaussian().loss_forward(traj, LossRequest(kl="gaussian")).kl_B_T, 2.0 * traj.mask_B_T)
    # Flow-GRPO's KL: the policy's exact KL times its step weights (0.25 here), by the estimator's own formula
    assert torch.equal(Gaussian().loss_forward(traj, LossRequest(kl="gaussian_g2")).kl_B_T, 0.5 * traj.mask_B_T)
    assert Plain().log_prob_estimator == "sampler"


def test_capabilities_are_declared_by_the_policy_classes():
    from unialign.image.denoiser import DenoiserPolicy
    from unialign.image.flow_policy import FlowPolicyBase
    from unialign.image.policy import DiffusionPolicy
    from unialign.text.policy import CausalLMPolicy
    from unialign.vision.policy import VisionLanguagePolicy

    declared = {cls: {c for c in CAPABILITIES if c in cls.__mro__} for cls in
                (CausalLMPolicy, VisionLanguagePolicy, DiffusionPolicy, FlowPolicyBase)}
    assert declared[CausalLMPolicy] == declared[VisionLanguagePolicy] == {Critic, SamplingCopy}
    assert declared[DiffusionPolicy] == set(CAPABILITIES) - {Critic, KLWeights, SamplingCopy}
    assert declared[FlowPolicyBase] == set(CAPABILITIES) - {Critic, SamplingCopy}
    assert issubclass(DenoiserPolicy, StepChunks) and not issubclass(CausalLMPolicy, StepChunks)
    assert all(issubclass(cls, PolicyBase) for cls in declared)


def test_the_design_notes_table_is_the_capabilities_of_the_code():
    text = (ROOT / "docs/design.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| .* \| (.+) \|$", text, flags=re.M))
    assert set(rows) == {c.__name__ for c in CAPABILITIES}, "docs/design.md's capability table is stale"
    import unialign.dlm.policy
    import unialign.image.denoiser
    import unialign.image.flow_policy
    import unialign.text.policy

    classes = {c.__name__: c for m in (unialign.text.policy, unialign.image.denoiser, unialign.image.flow_policy,
                                       unialign.dlm.policy)
               for c in vars(m).values() if isinstance(c, type)}
    for capability, who in rows.items():
        named = re.findall(r"`(\w+)`", who)
        assert named and all(getattr(seam, capability) in classes[n].__mro__ for n in named), (capability, who)


def test_the_trainers_never_probe_a_policy_for_a_method():
    bad = []
    for path in sorted((ROOT / "unialign/trainers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and node.args
                    and ast.unparse(node.args[0]).split(".")[-1] == "policy"):
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "trainers ask a policy through its declared capabilities, not hasattr / getattr:\n" + "\n".join(bad)


def test_a_text_policy_is_refused_what_only_a_declared_capability_gives(tiny_policy, tmp_path):
    from unialign.trainers import OnlineConfig, OnlineTrainer

    common = dict(num_generations=2, prompts_per_step=1, report_to="none", output_dir=str(tmp_path))
    reward = lambda prompts, completions: [0.0] * len(completions)  # noqa: E731
    with pytest.raises(ValueError, match="needs a policy with Gaussian steps"):
        OnlineTrainer(tiny_policy, reward, [{"prompt": "1+1?"}], OnlineConfig(beta=0.1, kl_estimator="gaussian",
                                                                             **common))


def test_a_reference_is_a_policy_that_answers_log_probs_only(tiny_policy):
    from unialign.policy import Policy

    ref = tiny_policy.reference()
    traj = tiny_policy.sample(["1+1=", "2+2="])
    assert isinstance(ref, Policy) and ref.log_prob_estimator == tiny_policy.log_prob_estimator
    out = ref.loss_forward(traj, LossRequest())
    assert torch.equal(out.logp_B_T, ref.log_prob(traj)) and not out.logp_B_T.requires_grad
    with pytest.raises(ValueError, match="reference policy answers log-probs and entropy only"):
        ref.loss_forward(traj, LossRequest(values=True))
