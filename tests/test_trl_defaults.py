"""Defaults that fit the model: TRL's for a user's model (checked against the installed TRL), the shipped models'
measured values for those models only, and every remaining difference from TRL printed at start and recorded."""

from __future__ import annotations

import math

import pytest

from tests.test_scripts import load_script
from unialign.config import origin, parse_config
from unialign.trl_compat import TRL_DEFAULTS, trl_departures


def _same_steps_schedule_and_names(theirs, ours, names: set[str]) -> tuple[list[dict], list[dict]]:
    """TRL's trainer and unialign's after training: the same logged steps (1, 2, 3), the same learning rate at each,
    ``names`` in both logs. Returns their logged rows."""
    t_rows = [h for h in theirs.state.log_history if "loss" in h]
    o_rows = [h for h in ours.state.log_history if "loss" in h]
    assert [h["step"] for h in o_rows] == [h["step"] for h in t_rows] == [1, 2, 3]
    assert [h["learning_rate"] for h in o_rows] == pytest.approx([h["learning_rate"] for h in t_rows])
    assert names <= set(t_rows[0]) and names <= set(o_rows[0]), (names - set(t_rows[0]), names - set(o_rows[0]))
    return t_rows, o_rows


def _trl_config(name: str):
    trl = pytest.importorskip("trl")
    return getattr(trl, name)(output_dir="/tmp/unialign-trl-defaults", bf16=False, use_cpu=True)


@pytest.mark.parametrize("name", sorted(TRL_DEFAULTS))
def test_the_table_of_trl_defaults_is_the_installed_trls(name):
    cfg = _trl_config(name)
    spelling = {"loss_type": {"dapo": "token_mean"}}  # TRL's names in unialign's spelling
    for field, value in TRL_DEFAULTS[name].items():
        theirs = getattr(cfg, field)
        theirs = theirs[0] if isinstance(theirs, list) and len(theirs) == 1 else theirs  # DPO's loss_type list
        theirs = getattr(theirs, "value", theirs)  # transformers' SchedulerType enum
        assert spelling.get(field, {}).get(theirs, theirs) == value, (name, field)


def test_the_python_api_configs_start_from_trls_defaults():
    from unialign import DPOConfig, GRPOConfig

    grpo, dpo = GRPOConfig(output_dir="/tmp/x-grpo"), DPOConfig(output_dir="/tmp/x-dpo")
    assert (grpo.learning_rate, grpo.lr_scheduler_type, grpo.beta, grpo.seed, grpo.max_completion_length) == \
        (1e-6, "linear", 0.0, 42, 512)
    assert (dpo.learning_rate, dpo.lr_scheduler_type, dpo.seed) == (1e-6, "linear", 42)
    # what remains different is one documented line each; what the user sets is theirs
    assert [d["field"] for d in trl_departures(grpo, origin(grpo))] == ["gradient_checkpointing", "loss_type"]
    dapo = GRPOConfig(output_dir="/tmp/x-grpo", loss_type="dapo", gradient_checkpointing=False)
    assert trl_departures(dapo, origin(dapo)) == []  # set by the user, even to unialign's value: theirs
    assert [d["field"] for d in trl_departures(dpo, origin(dpo))] == ["gradient_checkpointing"]


def _cfg(script: str, argv: list[str], tmp_path):
    module = load_script(script)
    cls = next(v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
               and v.__module__ == module.__name__)
    return parse_config(cls, argv + ["--output_dir", str(tmp_path / "out")])


@pytest.mark.parametrize("script,tuned", [
    ("grpo_math", dict(learning_rate=3e-4, lr_scheduler_type="cosine", warmup_steps=5, max_new_tokens=32)),
    ("dpo_text", dict(learning_rate=2e-4, lr_scheduler_type="constant", batch_size=32)),
    ("train_reward_model", dict(learning_rate=1e-3, lr_scheduler_type="cosine", max_steps=600, batch_size=64)),
    ("ppo_rlhf", dict(learning_rate=1e-4, beta=0.5, max_new_tokens=24)),
    ("grpo_vision", dict(learning_rate=1e-3, lr_scheduler_type="cosine", max_new_tokens=8)),
])
def test_the_shipped_models_defaults_apply_to_them_only(tmp_path, script, tuned):
    shipped = _cfg(script, [], tmp_path)
    assert {k: getattr(shipped, k) for k in tuned} == tuned and origin(shipped)["model_defaults"]
    mine = _cfg(script, ["--model_name_or_path", str(tmp_path / "my_model")], tmp_path)
    assert origin(mine)["model_defaults"] == {} and all(getattr(mine, k) != v for k, v in tuned.items())
    assert mine.num_threads is None  # the loop picks one thread for a small model on CPU, torch's otherwise
    trl = getattr(type(mine), "TRL_CONFIG", None)
    if trl:  # a user's model: TRL's learning rate and schedule
        assert (mine.learning_rate, mine.lr_scheduler_type) == (TRL_DEFAULTS[trl]["learning_rate"], "linear")
    # a flag wins over the model's default, and is not reported as a departure
    flagged = _cfg(script, ["--learning_rate", "5e-3"], tmp_path)
    assert flagged.learning_rate == 5e-3 and "learning_rate" not in origin(flagged)["model_defaults"]
    assert all(d["field"] != "learning_rate" for d in trl_departures(flagged, origin(flagged)))


def test_a_users_model_gets_trls_values_and_the_departures_are_printed(tmp_path, capsys):
    from accelerate import Accelerator

    from unialign.trainers.outputs import announce_defaults, defaults_record

    mine = _cfg("grpo_math", ["--model_name_or_path", str(tmp_path / "my_qwen")], tmp_path)
    assert (mine.learning_rate, mine.lr_scheduler_type, mine.warmup_steps, mine.max_new_tokens) == \
        (1e-6, "linear", 0, 512)
    announce_defaults(Accelerator(cpu=True), mine)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines and all(line.startswith("default differs from TRL's GRPOConfig: ") for line in lines)
    assert {line.split(": ")[1].split("=")[0] for line in lines} == {"seed", "loss_type", "gradient_checkpointing"}
    shipped = _cfg("grpo_math", [], tmp_path)
    announce_defaults(Accelerator(cpu=True), shipped)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("defaults for the model 'embedded'") and "learning_rate=0.0003" in first
    record = defaults_record(shipped)
    assert record["model_defaults"]["values"]["lr_scheduler_type"] == "cosine"
    assert {d["field"] for d in record["trl_departures"]} >= {"learning_rate", "lr_scheduler_type", "warmup_steps"}


TRL_DPO_METRICS = {"loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                   "rewards/margins", "logps/chosen", "logps/rejected"}


def test_dpo_side_by_side_with_trl_same_steps_schedule_and_metric_names(tmp_path):
    """TRL's DPOTrainer and unialign's on the same tiny model and pairs, TRL's defaults: the same number of steps,
    the same learning rate at every step (TRL's linear schedule), TRL's metric names logged (unialign's kept too),
    and the same loss on the first step, where both policies are their reference (log 2)."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unialign import DPOConfig, DPOTrainer
    from unialign.embedded import ARITH_LM_DIR
    from unialign.embedded.arith import preference_pairs

    pairs = Dataset.from_list(preference_pairs("train", n=16))
    common = dict(per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, report_to="none")
    theirs = trl.DPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(ARITH_LM_DIR)),
                            processing_class=AutoTokenizer.from_pretrained(str(ARITH_LM_DIR)), train_dataset=pairs,
                            args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), logging_steps=1, bf16=False,
                                               use_cpu=True, save_strategy="no", **common))
    theirs.train()
    ours = DPOTrainer(model=str(ARITH_LM_DIR), train_dataset=pairs, args=DPOConfig(output_dir=str(tmp_path / "ours"),
                                                                                     **common))
    ours.train()
    t_rows, o_rows = _same_steps_schedule_and_names(theirs, ours, TRL_DPO_METRICS)
    assert o_rows[0]["loss"] == pytest.approx(t_rows[0]["loss"], abs=1e-6) == pytest.approx(math.log(2), abs=1e-6)
    assert o_rows[0]["rewards/accuracies"] == t_rows[0]["rewards/accuracies"] == 0.0  # ties count 0, as TRL
    assert o_rows[0]["implicit_accuracy"] == 0.5  # unialign's own, ties 1/2


class _Recorder:
    """A transformers TrainerCallback recording each event and what it was given."""

    def __new__(cls, stop_at: int | None = None):
        from transformers import TrainerCallback

        class Recorder(TrainerCallback):
            def __init__(self):
                self.events, self.stop_at = [], stop_at

            def on_train_begin(self, args, state, control, **kw):
                self.events.append(("on_train_begin", state.global_step))

            def on_step_end(self, args, state, control, **kw):
                self.events.append(("on_step_end", state.global_step))
                assert kw["model"] is not None and kw["optimizer"] is not None
                if self.stop_at is not None and state.global_step >= self.stop_at:
                    control.should_training_stop = True

            def on_log(self, args, state, control, logs=None, **kw):
                self.events.append(("on_log", state.global_step, "loss" in logs, "learning_rate" in logs))

            def on_evaluate(self, args, state, control, metrics=None, **kw):
                self.events.append(("on_evaluate", state.global_step, bool(metrics)))

            def on_save(self, args, state, control, **kw):
                self.events.append(("on_save", state.global_step))

            def on_train_end(self, args, state, control, **kw):
                self.events.append(("on_train_end", state.global_step, len(state.log_history)))

        return Recorder()


def test_trainer_callbacks_see_trls_events_and_can_stop_the_run(tmp_path):
    from datasets import Dataset

    from unialign import DPOConfig, DPOTrainer
    from unialign.embedded import ARITH_LM_DIR
    from unialign.embedded.arith import preference_pairs

    pairs = Dataset.from_list(preference_pairs("train", n=24))
    recorder = _Recorder()
    args = DPOConfig(output_dir=str(tmp_path / "a"), per_device_train_batch_size=4, max_steps=3, report_to="none",
                     eval_steps=2)
    trainer = DPOTrainer(model=str(ARITH_LM_DIR), args=args, train_dataset=pairs.select(range(16)),
                         eval_dataset=pairs.select(range(16, 24)), callbacks=[recorder])
    trainer.train()
    names = [e[0] for e in recorder.events]
    assert names[0] == "on_train_begin" and names[-1] == "on_train_end"
    assert [e[1] for e in recorder.events if e[0] == "on_step_end"] == [1, 2, 3]
    assert all(e[2] and e[3] for e in recorder.events if e[0] == "on_log")  # the step's metrics, TRL's names too
    assert ("on_evaluate", 2, True) in recorder.events and ("on_save", 3) in recorder.events
    # a callback stops the run: it ends there as at max_steps (evaluated, checkpointed, final/ written)
    stopper = _Recorder(stop_at=1)
    args = DPOConfig(output_dir=str(tmp_path / "b"), per_device_train_batch_size=4, max_steps=5, report_to="none")
    trainer = DPOTrainer(model=str(ARITH_LM_DIR), args=args, train_dataset=pairs)
    trainer.add_callback(stopper)
    out = trainer.train()
    assert out.global_step == 1 and (tmp_path / "b" / "final" / "config.json").is_file()
    assert ("on_save", 1) in stopper.events


def test_every_remaining_departure_has_its_row_in_the_docs():
    from pathlib import Path

    from unialign.trl_compat import TRL_DEPARTURES

    doc = (Path(__file__).resolve().parents[1] / "docs" / "coming_from_trl.md").read_text()
    table = doc[doc.index("## Where unialign's defaults deliberately differ from TRL's"):]
    for _, field in TRL_DEPARTURES:
        assert f"`{field}`" in table, field


TRL_GRPO_METRICS = {"loss", "grad_norm", "learning_rate", "reward", "reward_std", "rewards/math_accuracy/mean",
                    "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean",
                    "clip_ratio/low_mean", "clip_ratio/high_mean", "entropy", "frac_reward_zero_std"}


def test_grpo_side_by_side_with_trl_same_steps_schedule_and_metric_names(tmp_path):
    """TRL's GRPOTrainer and unialign's on the same tiny model, rows and reward: the same steps, the same learning
    rate at every step, TRL's metric names in both logs."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unialign import GRPOConfig, GRPOTrainer
    from unialign.embedded import ARITH_LM_DIR
    from unialign.embedded.arith import arithmetic_dataset
    from unialign.rewards import get_reward

    accuracy = get_reward("math_accuracy")

    def math_accuracy(prompts, completions, answer, **kwargs):
        return accuracy(prompts, completions, answer=answer)

    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}],
                               "answer": r["answer"].split("#### ")[-1]} for r in arithmetic_dataset("train", n=16)])
    common = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=24, max_steps=3,
                  learning_rate=1e-4, report_to="none")
    theirs = trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(ARITH_LM_DIR)),
                             processing_class=AutoTokenizer.from_pretrained(str(ARITH_LM_DIR)),
                             reward_funcs=[math_accuracy], train_dataset=rows,
                             args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), logging_steps=1, bf16=False,
                                                 use_cpu=True, save_strategy="no", **common))
    theirs.train()
    ours = GRPOTrainer(model=str(ARITH_LM_DIR), reward_funcs=[math_accuracy], train_dataset=rows,
                       args=GRPOConfig(output_dir=str(tmp_path / "ours"), **common))
    ours.train()
    t_rows, o_rows = _same_steps_schedule_and_names(theirs, ours, TRL_GRPO_METRICS)
    assert all(0.0 <= h["reward"] <= 1.0 for h in o_rows)


TRL_REWARD_METRICS = {"loss", "grad_norm", "learning_rate", "accuracy", "margin", "min_reward", "mean_reward",
                      "max_reward"}


def test_reward_trainer_side_by_side_with_trl_same_steps_schedule_and_metric_names(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from unialign import RewardConfig, RewardTrainer
    from unialign.embedded import ARITH_LM_DIR
    from unialign.embedded.arith import preference_pairs

    pairs = Dataset.from_list(preference_pairs("train", n=16))
    common = dict(per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, report_to="none")
    tokenizer = AutoTokenizer.from_pretrained(str(ARITH_LM_DIR))
    model = AutoModelForSequenceClassification.from_pretrained(str(ARITH_LM_DIR), num_labels=1)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    theirs = trl.RewardTrainer(model=model, processing_class=tokenizer, train_dataset=pairs,
                               args=trl.RewardConfig(output_dir=str(tmp_path / "trl"), logging_steps=1, bf16=False,
                                                     use_cpu=True, save_strategy="no", **common))
    theirs.train()
    ours = RewardTrainer(model=str(ARITH_LM_DIR), train_dataset=pairs,
                         args=RewardConfig(output_dir=str(tmp_path / "ours"), **common))
    ours.train()
    _same_steps_schedule_and_names(theirs, ours, TRL_REWARD_METRICS)


def test_callbacks_see_the_same_step_events_as_under_trl(tmp_path):
    """One TrainerCallback class on TRL's DPOTrainer and on unialign's: the same step events in the same order
    (on_step_end then on_log, at steps 1, 2, 3), between on_train_begin and on_train_end."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unialign import DPOConfig, DPOTrainer
    from unialign.embedded import ARITH_LM_DIR
    from unialign.embedded.arith import preference_pairs

    pairs = Dataset.from_list(preference_pairs("train", n=12))
    common = dict(per_device_train_batch_size=4, max_steps=3, report_to="none")
    theirs, ours = _Recorder(), _Recorder()
    trl.DPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(ARITH_LM_DIR)), train_dataset=pairs,
                   processing_class=AutoTokenizer.from_pretrained(str(ARITH_LM_DIR)), callbacks=[theirs],
                   args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), logging_steps=1, bf16=False, use_cpu=True,
                                      save_strategy="no", **common)).train()
    DPOTrainer(model=str(ARITH_LM_DIR), train_dataset=pairs, callbacks=[ours],
               args=DPOConfig(output_dir=str(tmp_path / "ours"), **common)).train()

    def steps(events):
        return [e[:2] for e in events if e[0] in ("on_step_end", "on_log") and e[1] >= 1][:6]

    assert steps(ours.events) == steps(theirs.events) == [(name, k) for k in (1, 2, 3)
                                                          for name in ("on_step_end", "on_log")]
    for recorder in (theirs, ours):
        assert recorder.events[0][0] == "on_train_begin" and recorder.events[-1][0] == "on_train_end"


def test_sft_and_rloo_side_by_side_with_trl_same_steps_schedule_and_names(tmp_path):
    """TRL's SFTTrainer / RLOOTrainer and unialign's on the same model and rows, TRL's defaults: the same steps, the
    same learning rate at every step, TRL's names of the loss, the gradient norm and (RLOO) the reward."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unialign import RLOOConfig, RLOOTrainer, SFTConfig, SFTTrainer
    from unialign.embedded import ARITH_LM_DIR
    from unialign.embedded.arith import arithmetic_dataset
    from unialign.rewards import get_reward

    def hf(cls, config, **kw):
        return cls(model=AutoModelForCausalLM.from_pretrained(str(ARITH_LM_DIR)),
                   processing_class=AutoTokenizer.from_pretrained(str(ARITH_LM_DIR)), args=config, **kw)

    trl_args = dict(logging_steps=1, bf16=False, use_cpu=True, save_strategy="no", report_to="none")
    common = dict(per_device_train_batch_size=4, max_steps=3, learning_rate=1e-4)
    sft_rows = Dataset.from_list([{"prompt": r["question"] + " ", "completion": r["answer"]}
                                  for r in arithmetic_dataset("train", n=16)])
    accuracy = get_reward("math_accuracy")

    def math_accuracy(prompts, completions, answer, **kwargs):
        return accuracy(prompts, completions, answer=answer)

    rl_rows = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}],
                                  "answer": r["answer"].split("#### ")[-1]} for r in arithmetic_dataset("train", n=16)])
    pairs = [
        (hf(trl.SFTTrainer, trl.SFTConfig(output_dir=str(tmp_path / "t1"), **common, **trl_args),
            train_dataset=sft_rows),
         SFTTrainer(model=str(ARITH_LM_DIR), train_dataset=sft_rows,
                    args=SFTConfig(output_dir=str(tmp_path / "o1"), report_to="none", **common)),
         {"loss", "grad_norm", "learning_rate"}),
        (hf(trl.RLOOTrainer, trl.RLOOConfig(output_dir=str(tmp_path / "t2"), max_completion_length=16, **common,
                                            **trl_args), reward_funcs=[math_accuracy], train_dataset=rl_rows),
         RLOOTrainer(model=str(ARITH_LM_DIR), reward_funcs=[math_accuracy], train_dataset=rl_rows,
                     args=RLOOConfig(output_dir=str(tmp_path / "o2"), max_completion_length=16, report_to="none",
                                     **common)),
         {"loss", "grad_norm", "learning_rate", "reward", "reward_std", "rewards/math_accuracy/mean"}),
    ]
    for theirs, ours, names in pairs:
        theirs.train()
        ours.train()
        _same_steps_schedule_and_names(theirs, ours, names)


def test_a_small_model_on_cpu_runs_on_one_thread_unless_told(tmp_path, capsys):
    """The Python API's num_threads unset: one torch thread for a model under 20 M parameters on CPU (what the
    scripts set), said once; --num_threads 0 leaves torch's choice."""
    import torch

    from unialign import DPOConfig, DPOTrainer
    from unialign.embedded import ARITH_LM_DIR
    from unialign.embedded.arith import preference_pairs

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        DPOTrainer(model=str(ARITH_LM_DIR), train_dataset=preference_pairs("train", n=8),
                   args=DPOConfig(output_dir=str(tmp_path / "a"), max_steps=1, report_to="none"))
        assert torch.get_num_threads() == 1 and "num_threads=1: a 0.5 M-parameter model" in capsys.readouterr().out
        torch.set_num_threads(2)
        DPOTrainer(model=str(ARITH_LM_DIR), train_dataset=preference_pairs("train", n=8),
                   args=DPOConfig(output_dir=str(tmp_path / "b"), max_steps=1, report_to="none", num_threads=0))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
