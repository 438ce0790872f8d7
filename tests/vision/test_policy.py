"""``VisionLanguagePolicy`` on three families: log-prob parity with an independent per-sample forward, micro-batching,
the prompt-prefix pass, row checks before any forward, one GRPO / DPO / PPO step, LoRA, save -> stock load."""

from __future__ import annotations

import io
import random

import pytest
import torch

from tests.vision.tiny import FAMILIES, build, random_image
from unialign.errors import UserError
from unialign.types import Trajectory
from unialign.vision import VisionLanguagePolicy, multimodal_prompt, vision_rows
from unialign.vision.media import load_image


def _prompts(seed: int = 0) -> list:
    """Rows of unequal text and image sizes, a two-image row, a text-only row; each twice (a group of 2)."""
    rng = random.Random(seed)
    user = [{"role": "user", "content": "What colour is it?"}]
    rows = [multimodal_prompt(user, [random_image(rng, (32, 32))]),
            multimodal_prompt([{"role": "user", "content": "Name the shape, briefly please"}],
                              [random_image(rng, (48, 40))]),
            multimodal_prompt([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                            {"type": "image"}, {"type": "text", "text": "?"}]}],
                              [random_image(rng, (32, 32)), random_image(rng, (32, 48))]),
            [{"role": "user", "content": "no image here"}]]
    return [p for p in rows for _ in range(2)]


def _policy(family: str, **kw) -> VisionLanguagePolicy:
    model, processor = build(family)
    return VisionLanguagePolicy(model, processor, max_new_tokens=6, **kw)


def _reference_logp(policy: VisionLanguagePolicy, prompt, completion_ids: torch.Tensor) -> torch.Tensor:
    """One sample, no batching, no padding, no fused head: the processor's own outputs (images and videos) + the
    completion, the model's own positions, ``log_softmax`` of the full logits gathered at the completion tokens."""
    from unialign.vision.media import prompt_images, prompt_videos

    images, videos = prompt_images(prompt), prompt_videos(prompt)
    enc = policy.processor(text=[policy.format_prompt(prompt)], images=[images] if images else None,
                           return_tensors="pt", add_special_tokens=False, **({"videos": videos} if videos else {}))
    W = enc["input_ids"].shape[1]
    kw = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in kw:
            kw[key] = torch.nn.functional.pad(kw[key], (0, completion_ids.numel()))
    ids = torch.cat([enc["input_ids"], completion_ids[None]], dim=1)
    head = policy.model.get_output_embeddings()
    hidden = policy.model.model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).last_hidden_state
    logits = torch.nn.functional.linear(hidden, head.weight, head.bias).float()
    return logits[0, W - 1:-1].log_softmax(-1).gather(-1, completion_ids[:, None]).squeeze(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_match_an_independent_per_sample_forward(family):
    policy = _policy(family)
    torch.manual_seed(0)
    traj = policy.sample(_prompts())
    assert torch.allclose(policy.log_prob(traj), traj.old_logp_B_T)  # the ratio-1 self-check's premise
    for i in range(len(traj)):
        n = int(traj.mask_B_T[i].sum())
        ref = _reference_logp(policy, traj.prompts[i], traj.payload["completion_ids"][i, :n])
        assert torch.allclose(traj.old_logp_B_T[i, :n], ref, atol=1e-5), (family, i)


@pytest.mark.parametrize("family", FAMILIES)
def test_micro_batches_and_the_prefix_pass_give_the_batch_logprobs(family):
    policy = _policy(family)
    torch.manual_seed(1)
    traj = policy.sample(_prompts(1))
    full = policy.log_prob(traj)
    policy.share_prompt_prefix = False
    plain = policy.log_prob(traj)
    assert torch.allclose(full, plain, atol=1e-5)
    # micro-batches of other rows, re-concatenated (their prompts right-padded by Trajectory.cat)
    parts = [traj.select([5, 0, 3]), traj.select([7]), traj.select([1, 2, 4, 6])]
    order = [5, 0, 3, 7, 1, 2, 4, 6]
    joined = policy.log_prob(Trajectory.cat(parts))
    assert torch.allclose(joined[:, :full.shape[1]], full[order], atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_tokens_other_images_do_not_share_a_prefix(family):
    policy = _policy(family)
    rng = random.Random(3)
    user = [{"role": "user", "content": "What colour is it?"}]
    a, b = (multimodal_prompt(user, [random_image(rng, (32, 32))]) for _ in range(2))
    torch.manual_seed(0)
    traj = policy.sample([a, a, b, b])
    shared = policy.log_prob(traj)
    policy.share_prompt_prefix = False
    assert torch.allclose(shared, policy.log_prob(traj), atol=1e-5)


def test_image_tokens_are_never_sampled():
    policy = _policy("qwen2_vl", temperature=1.0)
    head = policy.model.get_output_embeddings()
    with torch.no_grad():  # make the image token by far the likeliest next token
        head.weight[policy.image_ids[0]] *= 0
        head.weight[policy.image_ids[0]] += 50 * head.weight.mean(0)
    torch.manual_seed(0)
    traj = policy.sample(_prompts()[:4])
    ids = traj.payload["completion_ids"][traj.mask_B_T.bool()]
    assert not torch.isin(ids, torch.tensor(policy.image_ids)).any()


def test_placeholder_and_image_counts_are_checked_per_row():
    rng = random.Random(0)
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(UserError, match=r"data row 1: the prompt has 2 image placeholder\(s\) but the row has 1"):
        vision_rows([{"prompt": "ok"}, {"prompt": two, "image": random_image(rng)}], "data")
    with pytest.raises(UserError, match=r"data row 0: the prompt has 1 image placeholder\(s\) but the row has 2"):
        vision_rows([{"prompt": "look: <image>", "images": [random_image(rng), random_image(rng)]}], "data")
    policy = _policy("qwen2_vl")
    with pytest.raises(UserError, match="prompt row 0: 2 image block"):  # blocks without images, passed directly
        policy.sample([two])


def test_a_prompt_limit_never_cuts_image_tokens():
    rng = random.Random(0)
    prompt = multimodal_prompt([{"role": "user", "content": "What colour is it?"}], [random_image(rng, (32, 32))])
    policy = _policy("qwen2_vl", max_prompt_length=20)  # 16 image tokens + the template: over 20
    with pytest.raises(UserError, match=r"prompt row 0: \d+ tokens \(16 of them image tokens\) > max_prompt_length=20"):
        policy.sample([prompt])
    counts = policy.count_prompt_tokens([prompt, "plain"], 20)
    assert counts[0] > 20 and counts[1] == len("plain")  # the expanded image tokens are counted
    text_only = _policy("qwen2_vl", max_prompt_length=8)
    traj = text_only.sample(["a long text-only prompt"])  # text is cut from the left as for text policies
    assert traj.payload["prompt_ids"].shape[1] == 8


def test_image_formats_and_relative_paths(tmp_path):
    rng = random.Random(0)
    image = random_image(rng, (32, 32))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    (tmp_path / "imgs").mkdir()
    image.save(tmp_path / "imgs" / "a.png")
    for value in (image, buf.getvalue(), {"bytes": buf.getvalue(), "path": None}, "imgs/a.png",
                  {"bytes": None, "path": str(tmp_path / "imgs" / "a.png")}):
        loaded = load_image(value, tmp_path)
        assert loaded.size == (32, 32) and list(loaded.getdata()) == list(image.getdata())
    with pytest.raises(UserError, match="data row 0: field 'image': no image file at 'missing.png'"):
        vision_rows([{"prompt": "x", "image": "missing.png"}], "data", tmp_path)
    rows = vision_rows([{"prompt": "What is it?", "image": "imgs/a.png", "solution": "red"}], "data", tmp_path)
    assert rows[0]["solution"] == "red" and rows[0]["prompt"][0]["content"][0]["type"] == "image"


@pytest.mark.parametrize("family", FAMILIES)
def test_one_grpo_step_changes_the_language_model(family, tmp_path):
    from unialign.trainers import OnlineConfig, OnlineTrainer

    policy = _policy(family)
    rows = [{"prompt": p} for p in _prompts()[::2]]
    cfg = OnlineConfig(num_generations=2, prompts_per_step=2, micro_batch_size=2, max_steps=1, report_to="none",
                       output_dir=str(tmp_path), learning_rate=0.1, beta=0.04, seed=0)
    before = {k: v.clone() for k, v in policy.model.named_parameters()}
    reward = lambda prompts, completions: [float(sum(map(ord, c)) % 7) for c in completions]  # noqa: E731 (varies)
    OnlineTrainer(policy, reward, rows, cfg).train()
    changed = [k for k, v in policy.model.named_parameters() if not torch.equal(v, before[k])]
    assert any("embed_tokens" in k for k in changed), changed  # tied with the head
    assert any("layers.1." in k and "visual" not in k and "vision" not in k for k in changed), changed


def test_dpo_pairs_carry_the_images_and_match_per_pair_sums():
    policy = _policy("qwen2_vl")
    rng = random.Random(0)
    prompt = multimodal_prompt([{"role": "user", "content": "colour?"}], [random_image(rng, (32, 32))])
    other = multimodal_prompt([{"role": "user", "content": "colour?"}], [random_image(rng, (40, 32))])
    rows = [{"prompt": prompt, "chosen": "red", "rejected": "blue!"}, {"prompt": other, "chosen": "a", "rejected": "bb"}]
    batch = policy.preference_batch(rows)
    chosen, rejected = policy.sequence_log_prob(batch)
    for i, row in enumerate(rows):
        for side, value in (("chosen", chosen[i]), ("rejected", rejected[i])):
            ids = policy.tokenizer(row[side] + policy.tokenizer.eos_token, add_special_tokens=False,
                                   return_tensors="pt")["input_ids"][0]
            assert torch.allclose(value, _reference_logp(policy, row["prompt"], ids).sum(), atol=1e-4)


def test_ppo_critic_head_lora_and_stock_loading(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, processor = build("qwen2_vl")
    model.save_pretrained(tmp_path / "base")
    processor.save_pretrained(tmp_path / "base")
    policy = VisionLanguagePolicy.from_pretrained(str(tmp_path / "base"), lora_rank=4, value_head=True,
                                                  max_new_tokens=4)
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and not any("visual" in n and "lora" in n for n in trainable)  # the text tower's LoRA
    torch.manual_seed(0)
    traj = policy.sample(_prompts()[:2])
    logp, _, values = policy.log_prob_and_values(traj)
    assert values.shape == logp.shape and torch.allclose(logp, traj.old_logp_B_T, atol=1e-6)
    ref = policy.reference().log_prob(traj)
    assert torch.allclose(ref, logp, atol=1e-6)  # LoRA B = 0: the reference is the policy at start
    policy.save(str(tmp_path / "final"))
    loaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "base"))
    from peft import PeftModel

    PeftModel.from_pretrained(loaded, str(tmp_path / "final"))
    AutoProcessor.from_pretrained(str(tmp_path / "final"))
    with pytest.raises(ValueError, match="value_head"):
        VisionLanguagePolicy(*build("qwen2_vl"), value_head="separate")


def test_async_rollouts_sample_a_vlm_from_its_lagging_copy(tmp_path):
    """--async_rollouts on a VLM: the rollout thread samples from the copy (its own processor), the stale batch's
    behaviour log-probs are the previous weights' on the same images."""
    import copy

    from tests.trainers.test_async_rollouts import train_keeping_batches
    from unialign.trainers import OnlineConfig, OnlineTrainer

    policy = _policy(FAMILIES[0])
    rows = [{"prompt": p} for p in _prompts()[::2]]
    cfg = OnlineConfig(num_generations=2, prompts_per_step=2, micro_batch_size=4, max_steps=2, report_to="none",
                       output_dir=str(tmp_path), learning_rate=0.1, beta=0.0, seed=0, async_rollouts=True)
    reward = lambda prompts, completions: [float(sum(map(ord, c)) % 7) for c in completions]  # noqa: E731 (varies)
    trainer = OnlineTrainer(policy, reward, rows, cfg)
    assert trainer.rollouts.view.processor is not policy.processor
    first, batches = train_keeping_batches(trainer)
    stale = batches[1]
    assert trainer.history[1]["async/lag"] == 1.0 and stale.rollout_logp_B_T is not None
    model = copy.deepcopy(policy.model)
    model.load_state_dict(first, strict=False)  # tied head: one name for both
    logp, _, _ = policy._forward(model, stale.payload, False)
    torch.testing.assert_close(stale.rollout_logp_B_T, logp * stale.mask_B_T, rtol=0, atol=1e-5)
