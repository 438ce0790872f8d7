"""TRL's ModelConfig / TrainingArguments knobs for text policies, each as TRL means it: LoRA alpha and target
modules (compared with TRL's own ``get_peft_config``), transformers' attention kernel, activation checkpointing,
bf16 autocast, the repetition penalty, trust_remote_code's warning line."""

from __future__ import annotations

import pytest
import torch

from unialign.embedded import ARITH_LM_DIR
from unialign.text.policy import CausalLMPolicy
from unialign.text.sampling import SamplingKnobs


def test_lora_alpha_and_target_modules_are_trls():
    trl = pytest.importorskip("trl")
    theirs = trl.get_peft_config(trl.ModelConfig(use_peft=True, lora_r=4, lora_alpha=8,
                                                 lora_target_modules=["q_proj", "v_proj"]))
    policy = CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR), lora_rank=4, lora_alpha=8,
                                            lora_target_modules=["q_proj", "v_proj"])
    ours = policy.model.peft_config["default"]
    assert (ours.r, ours.lora_alpha, set(ours.target_modules), ours.task_type) == \
        (theirs.r, theirs.lora_alpha, set(theirs.target_modules), theirs.task_type)
    adapted = {n.split(".lora_A")[0].split(".")[-1] for n, _ in policy.model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}


def test_the_script_flags_reach_the_policy(tmp_path):
    from tests.test_scripts import load_script
    from unialign.config import parse_config

    module = load_script("grpo_math")
    cfg = parse_config(module.GRPOMathConfig, ["--lora_rank", "2", "--lora_alpha", "16", "--lora_target_modules",
                                               "q_proj, k_proj", "--attn_implementation", "eager",
                                               "--gradient_checkpointing", "true", "--repetition_penalty", "1.3",
                                               "--output_dir", str(tmp_path)])
    assert cfg.model_kwargs() == dict(lora_rank=2, lora_alpha=16.0, lora_target_modules=["q_proj", "k_proj"],
                                      torch_dtype="float32", attn_implementation="eager",
                                      gradient_checkpointing=True, trust_remote_code=False)
    assert cfg.sampling().repetition_penalty == 1.3
    # TRL's spellings of the same: ModelConfig's lora_r / lora_alpha / lora_target_modules, TrainingArguments' bf16
    trl_cfg = parse_config(module.GRPOMathConfig, ["--lora_r", "2", "--lora_alpha", "16", "--bf16", "true",
                                                   "--output_dir", str(tmp_path)])
    assert (trl_cfg.lora_rank, trl_cfg.lora_alpha, trl_cfg.mixed_precision) == (2, 16.0, "bf16")


def test_attention_kernel_and_activation_checkpointing():
    eager = CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR), attn_implementation="eager")
    assert eager.model.config._attn_implementation == "eager"
    plain = CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR))
    ckpt = CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR), gradient_checkpointing=True, lora_rank=2)
    assert ckpt.model.base_model.model.is_activation_checkpointing and not plain.model.is_activation_checkpointing
    # the same gradients, recomputed: full model, checkpointed vs not
    full = CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR), gradient_checkpointing=True)
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    grads = []
    for policy in (plain, full):
        policy.model.train()
        policy.model.zero_grad()
        policy.model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_repetition_penalty_is_passed_to_every_engine_and_changes_what_is_sampled():
    knobs = SamplingKnobs(repetition_penalty=1.5)
    assert knobs.hf_kwargs()["repetition_penalty"] == 1.5 and knobs.vllm_kwargs()["repetition_penalty"] == 1.5
    assert "repetition_penalty" not in SamplingKnobs().hf_kwargs()  # off: the checkpoint's config is not overridden
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingKnobs(repetition_penalty=0.0)
    tokens = []
    for penalty in (1.0, 50.0):
        policy = CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR), sampling=SamplingKnobs(
            max_new_tokens=12, repetition_penalty=penalty))
        torch.manual_seed(0)
        tokens.append(policy.sample(["3+4="] * 4).completions)
    assert tokens[0] != tokens[1]


def test_trust_remote_code_is_said_once(capsys):
    CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR), trust_remote_code=True)
    out = capsys.readouterr().out
    assert out.count("trust_remote_code: running the modelling code of") == 1


def test_bf16_autocast_runs_the_forward_in_bf16(tmp_path):
    """--mixed_precision bf16 (TRL's --bf16): weights stay float32, the linear layers compute in bfloat16; no
    accelerate state is fixed by it (a later run in the same process may use another precision)."""
    from accelerate import Accelerator

    from unialign.trainers.loop import autocast_context

    policy = CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR))
    seen = []
    policy.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    acc = Accelerator(cpu=True)
    for mixed_precision in ("bf16", "no"):
        with autocast_context(mixed_precision, acc):
            policy.model(input_ids=torch.tensor([[1, 2, 3]]))
    assert seen == [torch.bfloat16, torch.float32] and next(policy.model.parameters()).dtype == torch.float32


def test_a_bf16_run_trains(tmp_path):
    from unialign import DPOConfig, DPOTrainer
    from unialign.embedded.arith import preference_pairs

    args = DPOConfig(output_dir=str(tmp_path), bf16=True, per_device_train_batch_size=4, max_steps=2,
                     learning_rate=1e-3, report_to="none")
    assert args.mixed_precision == "bf16"
    trainer = DPOTrainer(model=str(ARITH_LM_DIR), args=args, train_dataset=preference_pairs("train", n=8))
    out = trainer.train()
    assert out.global_step == 2 and all(h["loss"] == h["loss"] for h in trainer.state.log_history if "loss" in h)
