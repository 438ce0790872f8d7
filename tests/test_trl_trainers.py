"""TRL's other trainer classes as thin TRL-signature classes over unialign's loops: SFTTrainer (causal and
masked-diffusion LMs; its loss side by side with TRL's), RewardTrainer, RLOOTrainer; and scripts/sft.py."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_scripts import run
from unialign.embedded import ARITH_LM_DIR, MDLM_DIR
from unialign.embedded.arith import arithmetic_dataset, preference_pairs


def _sft_rows(n: int, sep: str = " ") -> list[dict]:
    return [{"prompt": r["question"] + sep, "completion": r["answer"]} for r in arithmetic_dataset("train", n=n)]


def test_sft_loss_is_trls_completion_only_token_mean(tmp_path):
    """The first step's loss of TRL's SFTTrainer (prompt-completion rows, completion_only_loss) and
    SFTObjective's on the same rows and model: the completion tokens' (and EOS's) mean NLL."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unialign.text.policy import CausalLMPolicy
    from unialign.text.sft import sft_rows
    from unialign.trainers.preference import SFTObjective

    rows = _sft_rows(8)
    theirs = trl.SFTTrainer(model=AutoModelForCausalLM.from_pretrained(str(ARITH_LM_DIR)),
                            processing_class=AutoTokenizer.from_pretrained(str(ARITH_LM_DIR)),
                            train_dataset=Dataset.from_list(rows),
                            args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8,
                                               max_steps=1, logging_steps=1, report_to="none", bf16=False,
                                               use_cpu=True, save_strategy="no"))
    theirs.train()
    trl_loss = next(h["loss"] for h in theirs.state.log_history if "loss" in h)
    obj = SFTObjective(CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR)), sft_rows(rows))
    obj.begin_step(list(range(8)))
    losses, _ = obj.losses(obj.batch(obj.rows), list(range(8)))
    assert float(losses.sum() / 8) == pytest.approx(trl_loss, rel=1e-5)


def test_sft_token_mean_does_not_depend_on_the_micro_batches():
    from unialign.text.policy import CausalLMPolicy
    from unialign.text.sft import sft_rows
    from unialign.trainers.preference import SFTObjective

    obj = SFTObjective(CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR)), sft_rows(_sft_rows(6)))
    obj.begin_step(list(range(6)))
    whole = obj.losses(obj.batch(obj.rows), list(range(6)))[0].sum()
    parts = sum(obj.losses(obj.batch(obj.rows[i:i + 2]), list(range(i, i + 2)))[0].sum() for i in (0, 2, 4))
    torch.testing.assert_close(whole, parts)


def test_sft_rows_in_trls_formats_and_a_bad_row_named():
    from unialign.errors import UserError
    from unialign.text.sft import sft_rows

    rows = sft_rows([
        {"prompt": "a", "completion": "b"},
        {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "r"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}], "id": 3},
        {"question": "q", "answer": "r"}])
    assert rows[1]["completion"] == "r" and rows[2] == {"prompt": [{"role": "user", "content": "q"}],
                                                        "completion": "r", "id": 3}
    with pytest.raises(UserError, match=r"x row 1: an SFT row needs 'prompt' and 'completion'.*columns: \['text'\]"):
        sft_rows([{"prompt": "a", "completion": "b"}, {"text": "plain"}], "x")
    with pytest.raises(UserError, match="must end with the assistant's turn"):
        sft_rows([{"messages": [{"role": "user", "content": "q"}]}])


@pytest.mark.parametrize("model", [ARITH_LM_DIR, MDLM_DIR])
def test_sft_trainer_lowers_the_held_out_nll(tmp_path, model):
    from datasets import Dataset

    from unialign import SFTConfig, SFTTrainer

    rows = _sft_rows(40)
    trainer = SFTTrainer(model=str(model), train_dataset=Dataset.from_list(rows[:32]),
                         eval_dataset=Dataset.from_list(rows[32:]),
                         args=SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=6,
                                        learning_rate=1e-3, report_to="none"))
    trainer.train()
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["metric"] == "nll_per_token" and s["after"] < s["before"] and s["steps"] == 6
    assert (tmp_path / "final" / "config.json").is_file()


def test_reward_trainer_and_rloo_trainer_take_trls_signature(tmp_path):
    from datasets import Dataset

    from unialign import RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer

    pairs = Dataset.from_list(preference_pairs("train", n=24))
    rm = RewardTrainer(model=str(ARITH_LM_DIR), train_dataset=pairs.select(range(16)),
                       eval_dataset=pairs.select(range(16, 24)),
                       args=RewardConfig(output_dir=str(tmp_path / "rm"), per_device_train_batch_size=8, max_steps=3,
                                         report_to="none"))
    rm.train()
    assert rm.summary["metric"] == "accuracy" and 0.0 <= rm.summary["after"] <= 1.0
    assert {"margin", "mean_reward", "learning_rate"} <= set(next(h for h in rm.state.log_history if "loss" in h))
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm" / "final"))
    args = RLOOConfig(output_dir=str(tmp_path / "rloo"), per_device_train_batch_size=4, max_completion_length=8,
                      max_steps=1, report_to="none")
    assert (args.algorithm, args.num_generations, args.beta, args.prompts_per_step) == ("rloo", 2, 0.05, 2)
    assert RLOOConfig(output_dir="/tmp/x", num_generations=4).num_generations == 4  # the user's value wins
    rows = [{"prompt": r["question"], "answer": r["answer"].split("#### ")[-1]} for r in arithmetic_dataset("train", n=4)]
    trainer = RLOOTrainer(model=str(ARITH_LM_DIR), reward_funcs="math_accuracy", args=args, train_dataset=rows)
    trainer.train()
    assert trainer.summary["algorithm_spec"]["advantage"] == "rloo" and trainer.state.global_step == 1


@pytest.mark.slow
@pytest.mark.parametrize("model", ["embedded", "embedded-mdlm"])
def test_sft_script_on_the_embedded_models(tmp_path, model):
    s = run("sft", ["--model_name_or_path", model, "--max_steps", "3", "--num_eval", "16", "--output_dir",
                    str(tmp_path), "--report_to", "none"])
    assert s["metric"] == "accuracy" and s["steps"] == 3 and s["nll_after"] < s["nll_before"]
    assert s["model_defaults"]["model"] == model and (tmp_path / "loss_curve.png").exists()


def test_ppo_trainer_takes_trls_signature_reward_model_and_value_model(tmp_path):
    from datasets import Dataset

    from unialign import PPOConfig, PPOTrainer, RewardConfig, RewardTrainer
    from unialign.errors import UserError

    rm = RewardTrainer(model=str(ARITH_LM_DIR), train_dataset=Dataset.from_list(preference_pairs("train", n=8)),
                       args=RewardConfig(output_dir=str(tmp_path / "rm"), per_device_train_batch_size=8, max_steps=1,
                                         report_to="none"))
    rm.train()
    rows = [{"prompt": r["question"]} for r in arithmetic_dataset("train", n=8)]
    args = PPOConfig(output_dir=str(tmp_path / "ppo"), per_device_train_batch_size=4, max_completion_length=8,
                     max_steps=1, report_to="none")
    assert (args.algorithm, args.num_generations) == ("ppo", 1) and args.algo_spec().value_coef > 0
    for value_model in (None, str(tmp_path / "rm" / "final")):  # a value head, or TRL's separate value model
        trainer = PPOTrainer(args=args, model=str(ARITH_LM_DIR), reward_model=str(tmp_path / "rm" / "final"),
                             value_model=value_model, train_dataset=rows)
        assert trainer.policy.has_critic
        args.overwrite_output_dir = True
        trainer.train()
        assert trainer.state.global_step == 1 and "value_loss" in trainer.state.log_history[-1]
    with pytest.raises(UserError, match="ref_model: the reference is the initial model"):
        PPOTrainer(args=args, model=str(ARITH_LM_DIR), ref_model=object(), reward_model=str(tmp_path), train_dataset=rows)


def test_async_grpo_trainer_takes_trls_signature(tmp_path):
    from unialign import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig
    from unialign.config import UserError

    args = AsyncGRPOConfig(output_dir=str(tmp_path / "async"), per_device_train_batch_size=4, num_generations=2,
                           max_completion_length=8, max_steps=2, max_staleness=1, report_to="none")
    assert args.async_rollouts and args.max_staleness == 1
    rows = [{"prompt": r["question"], "answer": r["answer"].split("#### ")[-1]} for r in arithmetic_dataset("train", n=4)]
    trainer = AsyncGRPOTrainer(model=str(ARITH_LM_DIR), reward_funcs="math_accuracy", args=args, train_dataset=rows)
    trainer.train()
    assert [h["async/lag"] for h in trainer.state.log_history if "async/lag" in h] == [0.0, 1.0]
    with pytest.raises(UserError, match="AsyncGRPOTrainer: args has async_rollouts off"):
        AsyncGRPOTrainer(model=str(ARITH_LM_DIR), reward_funcs="math_accuracy", train_dataset=rows,
                         args=GRPOConfig(output_dir=str(tmp_path / "sync"), report_to="none"))
