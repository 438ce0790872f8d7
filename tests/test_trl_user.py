"""A TRL user's habits: TRL's flags, YAML keys and Python keywords, TRL's trainer signature, prompts
as TRL treats them, and the usual mistakes with the one line each gets (exit 2, before any model loads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.test_scripts import load_script, run_cli, write_jsonl
from unialign.config import parse_config
from unialign.embedded import ARITH_LM_DIR
from unialign.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def config(script: str, argv: list[str], tmp_path):
    module = load_script(script)
    cls = next(v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
               and v.__module__ == module.__name__)
    return parse_config(cls, [*argv, "--output_dir", str(tmp_path / "out")], presets=module.PRESETS)


# ---------------------------------------------------------------- the migration table
def test_docs_migration_table_is_generated_from_the_code():
    from unialign.trl_compat import migration_table, script_configs

    text = (ROOT / "docs" / "trl_migration.md").read_text()
    assert text.strip() == migration_table(script_configs()).strip(), \
        "docs/trl_migration.md is stale: python -m unialign.trl_compat > docs/trl_migration.md"


def test_every_common_trl_field_has_an_answer_in_its_script():
    from unialign.trl_compat import COMMON, describe, script_configs

    classes = script_configs()
    for trl_config, names in COMMON.items():
        for name in names:
            spelling, what = describe(name, classes[trl_config])
            assert spelling and what, f"{trl_config}.{name} has no unialign equivalent and no refusal"


# ---------------------------------------------------------------- flags and YAML keys with TRL's meaning
def test_trl_batch_flags_mean_what_they_mean_in_trl(tmp_path):
    cfg = config("grpo_math", ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "4"], tmp_path)
    # TRL: 16 x 4 = 64 completions per optimizer step, 8 per prompt -> 8 prompts
    assert (cfg.micro_batch_size, cfg.prompts_per_step, cfg.num_generations) == (16, 8, 8)
    cfg = config("dpo_text", ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"], tmp_path)
    assert (cfg.micro_batch_size, cfg.batch_size) == (4, 8)
    with pytest.raises(UserError, match="not a multiple of --num_generations 8"):
        config("grpo_math", ["--per_device_train_batch_size", "12"], tmp_path)


def test_max_completion_length_is_the_generation_length_in_the_grpo_scripts(tmp_path):
    assert config("grpo_math", ["--max_completion_length", "8"], tmp_path).max_new_tokens == 8
    assert config("ppo_rlhf", ["--max_completion_length=8"], tmp_path).max_new_tokens == 8
    assert config("dpo_text", ["--max_completion_length", "64"], tmp_path).max_completion_length == 64  # DPO's
    with pytest.raises(UserError, match="another name for --max_new_tokens; both are given"):
        config("grpo_math", ["--max_completion_length", "8", "--max_new_tokens", "9"], tmp_path)


def test_other_trl_aliases(tmp_path):
    cfg = config("grpo_math", ["--lora_r", "8", "--dataset_train_split", "tr", "--dataset_test_split", "te",
                               "--warmup_ratio", "0.1", "--max_steps", "35", "--use_vllm", "--eval_strategy", "no",
                               "--per_device_eval_batch_size", "7", "--log_completions", "true"], tmp_path)
    assert (cfg.lora_rank, cfg.train_split, cfg.eval_split) == (8, "tr", "te")
    assert (cfg.warmup_steps, cfg.generation_backend, cfg.eval_steps, cfg.eval_batch_size) == (4, "vllm", 0, 7)
    assert config("grpo_math", ["--use_peft", "true"], tmp_path).lora_rank == 16  # TRL's default lora_r
    assert config("train_reward_model", ["--center_rewards_coefficient", "0.01"], tmp_path).center_coef == 0.01


def test_trl_keys_in_a_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("per_device_train_batch_size: 8\ngradient_accumulation_steps: 2\nmax_completion_length: 16\n"
                    "lora_r: 4\nlearning_rate: 1.0e-5\n")
    cfg = config("grpo_math", ["--config", str(path)], tmp_path)
    assert (cfg.micro_batch_size, cfg.prompts_per_step, cfg.max_new_tokens, cfg.lora_rank) == (8, 2, 16, 4)
    assert cfg.learning_rate == 1e-5
    path.write_text("num_train_epochs: 3\n")
    with pytest.raises(UserError, match=r"run.yaml: --num_train_epochs \(TRL's name\): .*--max_steps"):
        config("grpo_math", ["--config", str(path)], tmp_path)
    path.write_text("learning_rat: 1.0e-5\n")
    with pytest.raises(UserError, match="did you mean 'learning_rate'"):
        config("grpo_math", ["--config", str(path)], tmp_path)


# ---------------------------------------------------------------- the usual mistakes: one line, exit 2
MISTAKES = [
    ("grpo_math", ["--num_train_epochs", "3"], "--num_train_epochs (TRL's name): unialign counts optimizer steps"),
    ("dpo_text", ["--fp16", "true"], "--mixed_precision fp16: fp16 autocast needs a GPU"),
    ("grpo_math", ["--load_in_4bit", "true"], "quantised (QLoRA) training is not supported"),
    ("grpo_math", ["--learning_rat", "1e-5"], "unknown flag --learning_rat (did you mean 'learning_rate'?)"),
    ("grpo_math", ["--algorithm", "grop"], "(did you mean 'grpo'?)"),
    ("grpo_math", ["--algorithm", "ddpo"], "'ddpo' is a preset for diffusion models"),
    ("ppo_rlhf", ["--algorithm", "flow_grpo"], "'flow_grpo' is a preset for diffusion models"),
    ("grpo_math", ["--reward_funcs", "math_acuracy"], "(did you mean 'math_accuracy'?)"),
    ("grpo_math", ["--reward_funcs", "aesthetic"], "'aesthetic' scores images, and this script samples text"),
    ("grpo_math", ["--model_name_or_path", "./no/such/model"], "no such file or directory"),
    ("dpo_text", ["--use_vllm"], "this script has no --generation_backend vllm setting"),
    ("grpo_math", ["--save_strategy", "epoch"], "--save_steps N"),
    ("grpo_math", ["--push_to_hub", "true"], "upload_folder"),
    ("grpo_math", ["--vllm_mode", "server"], "colocated"),
    ("grpo_math", ["stray"], "unrecognized argument 'stray'"),
]


@pytest.mark.parametrize(("script", "argv", "expected"), MISTAKES, ids=[" ".join(m[1]) for m in MISTAKES])
def test_a_mistake_gets_one_line_naming_the_fix(script, argv, expected, tmp_path, capsys):
    code, line = run_cli(script, [*argv, "--output_dir", str(tmp_path / "out"), "--report_to", "none"], capsys)
    assert code == 2 and expected in line, line


def test_an_uninstalled_tracker_is_an_error(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code, line = run_cli("grpo_math", ["--report_to", "wandb", "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 2 and "the wandb package is not installed" in line, line


def test_data_mistakes_name_the_columns(tmp_path, capsys):
    prompt_only = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"What is {i}+1?"} for i in range(20)])
    code, line = run_cli("grpo_math", ["--dataset_name", str(prompt_only), "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 2 and "the rows hold only a prompt" in line and "math_format" in line, line
    # {"question", "solution"} rows: the question is the prompt, the solution a reward column (no 'answer' needed)
    from unialign.recipes.text import check_rewards
    from unialign.text.data import prompt_rows

    rows = prompt_rows([{"question": "What is 2+2?", "solution": "4"}])
    assert rows == [{"prompt": "What is 2+2?", "solution": "4"}]
    check_rewards("math_accuracy", None, {"solution"})


def test_a_system_prompt_with_plain_string_prompts_is_refused(tmp_path, capsys):
    rows = write_jsonl(tmp_path / "s.jsonl", [{"prompt": f"What is {i}+1?", "solution": str(i + 1)} for i in range(20)])
    code, line = run_cli("grpo_math", ["--dataset_name", str(rows), "--system_prompt", "Be brief.",
                                       "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 2 and "--chat_template always" in line, line


def test_a_model_name_given_to_online_trainer_names_grpo_trainer():
    from unialign.trainers import OnlineConfig, OnlineTrainer

    with pytest.raises(TypeError, match="unialign.GRPOTrainer"):
        OnlineTrainer("Qwen/Qwen2.5-0.5B-Instruct", lambda completions, **k: [0.0] * len(completions),
                      [{"prompt": "hi"}], OnlineConfig())


# ---------------------------------------------------------------- prompts as TRL treats them
def test_string_prompts_raw_conversations_templated():
    from unialign.embedded import load_arith_policy

    policy = load_arith_policy(max_new_tokens=4)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    templated = policy.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert policy.format_prompt("What is 2+2?") == "What is 2+2?"  # TRL's standard format: raw
    assert policy.format_prompt(chat) == templated                    # conversational: the template
    policy.chat_template = "always"
    assert policy.format_prompt("What is 2+2?") == templated
    policy.chat_template = "never"
    assert policy.format_prompt(chat) == "What is 2+2?"
    with pytest.raises(ValueError, match="chat_template must be one of"):
        load_arith_policy(chat_template="sometimes")


@pytest.mark.slow
def test_max_completion_length_limits_the_completions(tmp_path):
    from tests.test_scripts import run

    out = tmp_path / "run"
    run("grpo_math", ["--max_completion_length", "6", "--max_steps", "1", "--prompts_per_step", "2",
                      "--num_generations", "2", "--num_eval", "4", "--output_dir", str(out), "--report_to", "none"])
    from unialign.embedded import load_arith_policy

    tok = load_arith_policy().tokenizer
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert rows and all(len(tok(r["completion"], add_special_tokens=False)["input_ids"]) <= 6 for r in rows)
    assert json.loads((out / "summary.json").read_text())["config"]["max_new_tokens"] == 6


# ---------------------------------------------------------------- TRL's trainer signature, in Python
@pytest.mark.slow
def test_trl_style_python_example_runs(tmp_path):
    """The README's TRL-style example, as a TRL user writes it."""
    from datasets import Dataset

    from unialign import GRPOConfig, GRPOTrainer
    from unialign.embedded.arith import arithmetic_dataset

    def brevity(completions, **kwargs):
        return [-len(c) / 100 for c in completions]

    rows = [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
            for r in arithmetic_dataset("train", n=32)]
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=16, num_generations=4,
                      max_completion_length=24, max_steps=2, learning_rate=1e-4, report_to="none")
    assert (args.prompts_per_step, args.micro_batch_size) == (4, 16)
    trainer = GRPOTrainer(model=ARITH_LM_DIR, reward_funcs=["math_accuracy", brevity], args=args,
                          train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:8]))
    out = trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    assert out.global_step == 2 and trainer.state.global_step == 2
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2]
    summary = json.loads((tmp_path / "grpo" / "summary.json").read_text())
    assert summary["metric"] == "reward" and isinstance(summary["before"], float) and summary["steps"] == 2
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    AutoModelForCausalLM.from_pretrained(tmp_path / "grpo" / "final")


def test_trl_style_dpo_trainer_runs(tmp_path):
    from datasets import Dataset

    from unialign import DPOConfig, DPOTrainer
    from unialign.embedded.arith import preference_pairs

    pairs = preference_pairs("train", n=24)
    # TRL's epochs: 16 pairs, 4 x 2 per optimizer step -> 2 steps (the Python trainers know the data size)
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                     num_train_epochs=1, warmup_ratio=0.5, learning_rate=1e-4, report_to="none",
                     chat_template="always")
    trainer = DPOTrainer(model=ARITH_LM_DIR, args=args, train_dataset=Dataset.from_list(pairs[:16]),
                         eval_dataset=Dataset.from_list(pairs[16:]))
    assert (args.max_steps, args.warmup_steps) == (2, 1)
    out = trainer.train()
    assert out.global_step == 2 and trainer.summary["metric"] == "implicit_accuracy"
    assert trainer.summary["before"] == 0.5  # policy == reference at the start: every pair a tie
    assert (tmp_path / "dpo" / "final" / "config.json").is_file()


def test_trl_config_keywords_refused_with_the_unialign_way(tmp_path):
    from unialign import DPOConfig, GRPOConfig

    with pytest.raises(UserError, match="--max_steps"):  # the scripts count steps
        config("grpo_math", ["--num_train_epochs", "3"], tmp_path)
    with pytest.raises(UserError, match="did you mean 'learning_rate'"):
        GRPOConfig(learning_rat=1e-5)
    assert DPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=8).batch_size == 16
    assert GRPOConfig().max_completion_length == 512  # TRL's defaults (tests/test_trl_defaults.py)
    given = GRPOConfig(num_train_epochs=3, max_steps=5)  # TRL: max_steps wins over epochs
    from unialign.trl import _steps_from_epochs

    _steps_from_epochs(given, 1000, 4)
    assert given.max_steps == 5


@pytest.mark.slow
def test_the_docs_trl_example_runs_as_written(tmp_path, monkeypatch):
    """The "Coming from TRL" page's code block (docs/coming_from_trl.md), executed as it is written (in a scratch
    folder)."""
    text = (ROOT / "docs" / "coming_from_trl.md").read_text()
    section = text[text.index("# Coming from TRL"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    code = code[:code.index("```")]
    assert "GRPOTrainer(" in code and "trainer.train()" in code
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "docs/coming_from_trl.md", "exec"), namespace)  # noqa: S102 - our own docs
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2 and (tmp_path / "out" / "grpo" / "summary.json").is_file()
    assert (tmp_path / "out" / "grpo" / "config.json").is_file()  # save_model(): args.output_dir, as TRL


def test_without_an_eval_dataset_the_numbers_come_from_training_rows_and_say_so(tmp_path, caplog):
    """TRL logs training completions; without eval_dataset the before / after reward and the completions table
    come from the first training rows, labelled as not held out."""
    from datasets import Dataset

    from unialign import GRPOConfig, GRPOTrainer
    from unialign.embedded.arith import arithmetic_dataset

    rows = [{"prompt": r["question"], "answer": r["answer"]} for r in arithmetic_dataset("train", n=8)]
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=1, report_to="none")
    trainer = GRPOTrainer(model=ARITH_LM_DIR, reward_funcs="math_accuracy", args=args,
                          train_dataset=Dataset.from_list(rows))
    trainer.train()
    summary = json.loads((tmp_path / "grpo" / "summary.json").read_text())
    assert isinstance(summary["before"], float) and isinstance(summary["after"], float)
    assert summary["eval_source"] == "train_dataset's first 8 rows (no eval_dataset given): not held out"
    assert (tmp_path / "grpo" / "completions.jsonl").read_text().strip()
    # final/ is for others to load too: the weights get a plain file's mode (safetensors writes 0600)
    mask = os.umask(0)
    os.umask(mask)
    weights = tmp_path / "grpo" / "final" / "model.safetensors"
    assert weights.stat().st_mode & 0o777 == 0o666 & ~mask
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    # the tied embeddings are saved once in every checkpoint without accelerate's warning each time
    assert (tmp_path / "grpo" / "checkpoint-1").is_dir()
    assert not [r for r in caplog.records if "Removed shared tensor" in r.getMessage()]


def test_python_api_errors_name_keywords_not_flags(tmp_path):
    from unialign import GRPOConfig, GRPOTrainer

    with pytest.raises(UserError, match=r"^unknown keyword learning_rat \(did you mean 'learning_rate'\?\)$"):
        GRPOConfig(learning_rat=1e-5)
    args = GRPOConfig(output_dir=str(tmp_path / "o"), learning_rate=-1.0)
    with pytest.raises(UserError, match=r"^learning_rate: must be >= 0.0, got -1.0$"):
        GRPOTrainer(model=ARITH_LM_DIR, reward_funcs="math_accuracy", args=args, train_dataset=[{"prompt": "a"}])
