"""MaskedDiffusionLMPolicy: loading rules, block decoding, shared masks, target alignment, VRPO pairs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from unialign.dlm import FAMILIES, DiffusionSampling, MaskedDiffusionLMPolicy, block_decode
from unialign.embedded.mdlm import build_model, build_tokenizer

PROMPTS = [[{"role": "user", "content": "Ann has 12 pens and buys 34 more. How many now?"}],
           [{"role": "user", "content": "Tom has 5 cups?"}]] * 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("mdlm")
    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=1, heads=2, intermediate=64, seed=1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def policy_of(path, **kw):
    kw.setdefault("sampling", DiffusionSampling(gen_length=8, block_length=4, steps=4))
    return MaskedDiffusionLMPolicy.from_pretrained(str(path), **kw)


def test_loads_natively_and_samples_with_seeds_and_a_step_map(tiny):
    policy = policy_of(tiny)
    assert policy.family.name == "modernbert" and policy.mask_id == policy.tokenizer.mask_token_id
    torch.manual_seed(0)
    traj = policy.sample(PROMPTS)
    p = traj.payload
    assert p["completion_ids"].shape == (4, 8) and not bool((p["completion_ids"] == policy.mask_id).any())
    assert sorted(set(p["step_map"].flatten().tolist())) == [0, 1, 2, 3]  # 2 tokens per step, 4 steps
    assert p["mask_seed"].shape == (4,) and traj.old_logp_B_T.shape == (4, 8)
    assert bool((traj.old_logp_B_T <= 0).all())


@pytest.mark.parametrize("estimator", ["one_step", "coupled", "elbo_mc", "elbo_quadrature", "spg", "trace", "ar_order"])
def test_old_reference_and_current_log_probs_share_masks(tiny, estimator):
    """The ratio-1 check at the first inner step holds exactly, whatever torch's RNG did in between."""
    policy = policy_of(tiny, estimator=estimator)
    torch.manual_seed(1)
    traj = policy.sample(PROMPTS)
    torch.rand(100)
    current = policy.log_prob(traj)
    assert current.requires_grad
    torch.testing.assert_close(current.detach(), traj.old_logp_B_T, rtol=0, atol=1e-6)
    torch.testing.assert_close(policy.reference().log_prob(traj), traj.old_logp_B_T, rtol=0, atol=1e-6)


class Shifted(torch.nn.Module):
    """A model whose position i predicts token i + 1 (Dream's convention), made from an aligned one."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kw):
        out = self.inner(**kw)
        out.logits = torch.cat([out.logits[:, 1:], out.logits[:, :1]], dim=1)
        return out


def test_target_alignment_is_read_from_the_family(tiny):
    aligned = policy_of(tiny)
    torch.manual_seed(2)
    traj = aligned.sample(PROMPTS)
    want = aligned.log_prob(traj).detach()
    shifted_model = Shifted(aligned.model)
    right = MaskedDiffusionLMPolicy(shifted_model, aligned.tokenizer, FAMILIES["dream"], sampling=aligned.sampling)
    wrong = MaskedDiffusionLMPolicy(shifted_model, aligned.tokenizer, FAMILIES["modernbert"], sampling=aligned.sampling)
    torch.testing.assert_close(right.log_prob(traj).detach(), want)
    assert (wrong.log_prob(traj).detach() - want).abs().max() > 0.1


def test_block_length_one_decodes_left_to_right_and_a_threshold_saves_forwards(tiny):
    policy = policy_of(tiny)
    enc = policy.prompt_encoder.encode(PROMPTS)
    logits = lambda x: policy._logits(policy.model, enc["input_ids"], enc["attention_mask"], x)  # noqa: E731
    _, step_map, forwards = block_decode(logits, 4, policy.mask_id, DiffusionSampling(8, 1, 8), greedy=True)
    assert forwards == 8 and bool((step_map == torch.arange(8)).all())
    _, _, full = block_decode(logits, 4, policy.mask_id, DiffusionSampling(8, 8, 8), greedy=True)
    _, _, fast = block_decode(logits, 4, policy.mask_id, DiffusionSampling(8, 8, 8, threshold=0.01), greedy=True)
    assert full == 8 and fast < full
    torch.manual_seed(0)
    x, step_map, forwards = block_decode(logits, 4, policy.mask_id, DiffusionSampling(8, 4, 4, remasking="random"))
    assert forwards == 4 and bool((torch.bincount(step_map[0], minlength=4) == 2).all())
    assert not bool((x == policy.mask_id).any())


def test_sampling_knobs_are_checked():
    with pytest.raises(ValueError, match="block_length"):
        DiffusionSampling(gen_length=10, block_length=4)
    with pytest.raises(ValueError, match="steps"):
        DiffusionSampling(gen_length=8, block_length=4, steps=3)


def _config_folder(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(tmp_path)


def test_remote_code_families_are_refused_without_the_flag(tmp_path):
    with pytest.raises(ValueError, match="is a llada model.*--trust_remote_code"):
        MaskedDiffusionLMPolicy.from_pretrained(_config_folder(tmp_path, "llada"))


def test_a_uniform_noise_model_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="uniform-noise discrete diffusion model.*not into a mask"):
        MaskedDiffusionLMPolicy.from_pretrained(_config_folder(tmp_path, "diffusion_gemma"))
    with pytest.raises(ValueError, match="not a known masked-diffusion LM family"):
        MaskedDiffusionLMPolicy.from_pretrained(_config_folder(tmp_path, "gpt2"))


def test_vrpo_pairs_share_masks_so_the_first_dpo_loss_is_ln2(tiny):
    from unialign.algos import dpo_loss

    policy = policy_of(tiny, estimator="elbo_mc")
    rows = [{"prompt": p, "chosen": "7+8=15", "rejected": "7+8=14\n#### 1"} for p in PROMPTS]
    torch.manual_seed(3)
    batch = policy.preference_batch(rows)
    assert torch.equal(batch.chosen["mask_seed"], batch.rejected["mask_seed"])
    chosen, rejected = policy.sequence_log_prob(batch)
    ref_chosen, ref_rejected = policy.reference().sequence_log_prob(batch)
    torch.testing.assert_close(chosen.detach(), ref_chosen)
    loss = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)[0].mean()
    assert float(loss) == pytest.approx(math.log(2), abs=1e-6)


def test_sampling_from_a_generator_leaves_the_global_rng_alone(tiny):
    """``sample(generator=...)`` (async rollouts): every draw (tokens, commits, mask seeds) from the generator; the
    same seed, the same trajectory."""
    policy = policy_of(tiny)
    before = torch.random.get_rng_state()
    a = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.rand(100)  # the global RNG moves; the generator's draws do not depend on it
    b = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(3))
    for key in ("completion_ids", "step_map", "mask_seed"):
        assert torch.equal(a.payload[key], b.payload[key]), key
    c = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(a.payload["mask_seed"], c.payload["mask_seed"])


def test_async_rollouts_sample_a_diffusion_lm_from_its_lagging_copy(tiny, tmp_path):
    import copy

    from tests.trainers.test_async_rollouts import train_keeping_batches
    from unialign.dist import unwrap
    from unialign.trainers import OnlineConfig, OnlineTrainer

    policy = policy_of(tiny)
    rows = [{"prompt": p} for p in PROMPTS[:2]] * 2
    cfg = OnlineConfig(algorithm="diffu_grpo", num_generations=2, prompts_per_step=2, micro_batch_size=4,
                       max_steps=2, report_to="none", output_dir=str(tmp_path), learning_rate=0.05, beta=0.0,
                       seed=0, async_rollouts=True, log_prob_estimator=policy.log_prob_estimator)
    reward = lambda prompts, completions: [float(sum(map(ord, c)) % 7) for c in completions]  # noqa: E731 (varies)
    trainer = OnlineTrainer(policy, reward, rows, cfg)
    first, batches = train_keeping_batches(trainer)
    stale = batches[1]
    assert trainer.history[1]["async/lag"] == 1.0 and stale.rollout_logp_B_T is not None
    model = copy.deepcopy(unwrap(policy.model))
    model.load_state_dict(first, strict=False)
    with torch.no_grad():
        logp = policy._estimate(model, stale.payload) * stale.mask_B_T
    torch.testing.assert_close(stale.rollout_logp_B_T, logp, rtol=0, atol=1e-5)
