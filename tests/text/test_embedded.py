"""The embedded offline default: arithmetic task, char tokenizer, shipped tiny Llama, evaluation; its builder
(``tools/build_arith_lm.py``, not installed) and the explicit registration of the demo worlds."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from unialign.embedded import arith as E

_ANSWER = re.compile(r"(\d)\+(\d)=(\d+),(\d)\+(\d)(\+1)?=(\d+)\n#### (\d+)")


def test_dataset_deterministic_and_schema():
    a = E.arithmetic_dataset("train", n=50, seed=3)
    b = E.arithmetic_dataset("train", n=50, seed=3)
    assert a == b
    assert E.arithmetic_dataset("train", n=50, seed=4) != a
    for row in a + E.arithmetic_dataset("test", n=50):
        assert set(row) == {"question", "answer"}
        assert _ANSWER.fullmatch(row["answer"]), row["answer"]
        assert len(row["answer"]) <= E.MAX_NEW_TOKENS - 1  # room for <|im_end|>
    assert E.worked_answer(47, 38) == "7+8=15,4+3+1=8\n#### 85"
    assert E.worked_answer(99, 99) == "9+9=18,9+9+1=19\n#### 198"
    assert E.worked_answer(47, 38, drop_carry=True) == "7+8=15,4+3=7\n#### 75"


def test_answers_parse_to_the_right_value():
    for row in E.arithmetic_dataset("test") + E.arithmetic_dataset("train"):
        x, y = map(int, re.fullmatch(r"\w+ has (\d+) \w+ and \w+ (\d+) more\. How many now\?",
                                     row["question"]).groups())
        m = _ANSWER.fullmatch(row["answer"])
        ua, ub, u, ta, tb, carry, t, final = m.groups()
        assert (int(ua), int(ub), int(ta), int(tb)) == (x % 10, y % 10, x // 10, y // 10)
        assert int(u) == x % 10 + y % 10 and bool(carry) == (int(u) >= 10)
        assert int(t) == x // 10 + y // 10 + bool(carry) and final == t + u[-1]
        assert E._operands(row["answer"]) == (x, y)
        assert E.parse_final_answer(row["answer"]) == str(x + y)
        assert E.is_correct(f"blah\n#### {x + y}", row["answer"])
        assert not E.is_correct(f"#### {x + y + 1}", row["answer"])
    assert E.parse_final_answer("no answer") is None
    assert E.parse_final_answer("#### 1,234") == "1234"


def test_splits_disjoint_and_seed_independent():
    def keys(rows):
        return {E._operands(r["answer"]) for r in rows}

    train, test = E.arithmetic_dataset("train"), E.arithmetic_dataset("test")
    assert len(test) > 1000 and len(train) > 5 * len(test)
    assert len(keys(train)) == len(train) and len(keys(test)) == len(test)
    assert keys(train).isdisjoint(keys(test))
    assert len(train) + len(test) == 90 * 90
    assert keys(E.arithmetic_dataset("test", seed=7)) == keys(test)
    with pytest.raises(ValueError):
        E.arithmetic_dataset("validation")


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = E.build_tokenizer()
    text = "Ann has 12 pens and buys 39 more.\n2+9=11,1+3+1=5\n#### 51"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    p = tok.apply_chat_template([{"role": "user", "content": "hi?"}], add_generation_prompt=True, tokenize=False)
    assert p == "<|im_start|>user\nhi?<|im_end|>\n<|im_start|>assistant\n"
    s = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "q"}],
                                tokenize=False)
    assert s == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
    pids = tok.encode(p, add_special_tokens=False)
    assert pids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>" and tok.padding_side == "left"
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert tok2.encode(p + text, add_special_tokens=False) == tok.encode(p + text, add_special_tokens=False)
    assert tok2.apply_chat_template([{"role": "user", "content": "hi?"}], add_generation_prompt=True,
                                    tokenize=False) == p
    assert tok2.padding_side == "left" and tok2.eos_token_id == tok.eos_token_id


def test_shipped_model_loads_offline_and_is_mid_way(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert (E.DEFAULT_ASSET_DIR / "model.safetensors").exists()
    size = sum(f.stat().st_size for f in E.DEFAULT_ASSET_DIR.iterdir())
    assert size < 5 * 2**20
    model, tok = E.load_arith_lm()
    assert model.config.model_type == "llama"
    assert model.generation_config.max_new_tokens == E.MAX_NEW_TOKENS
    rows = E.arithmetic_dataset("test", n=64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster, and immune to oversubscription
    try:
        acc = E.evaluate_accuracy(model, tok, rows)
    finally:
        torch.set_num_threads(threads)
    # BUILD.md: greedy 0.527 on 512 held-out rows: right on no-carry problems,
    # wrong on nearly every carry problem (the deliberate carry-drop label noise that GRPO then fixes)
    assert 0.3 <= acc <= 0.7, acc
    # generations stop at <|im_end|> and are in the task's format
    comp = E.generate_completions(model, tok, [rows[0]["question"]])[0][0]
    assert "####" in comp and len(comp) <= E.MAX_NEW_TOKENS
    from tools.build_arith_lm import DEFAULT_CARRY_DROP, DEFAULT_STEPS

    metrics = json.loads((E.DEFAULT_ASSET_DIR / "build_metrics.json").read_text())
    assert metrics["steps"] == DEFAULT_STEPS and metrics["carry_drop"] == DEFAULT_CARRY_DROP


def test_tiny_build_writes_loadable_files(tmp_path):
    from tools.build_arith_lm import BUILT_FILES, build

    threads = torch.get_num_threads()
    m = build(tmp_path, steps=3, batch_size=8, eval_rows=4, verbose=False, carry_drop=0.5)
    assert torch.get_num_threads() == threads
    assert {"greedy_acc", "pass_at_8", "train_seconds"} <= set(m)
    names = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "build_metrics.json"} <= names
    model, tok = E.load_arith_lm(tmp_path)
    rows = E.arithmetic_dataset("test", n=4)
    assert 0.0 <= E.evaluate_accuracy(model, tok, rows, max_new_tokens=4) <= 1.0
    # same seed -> same weights
    assert set(BUILT_FILES) == names  # what the check compares: every file the build writes
    m2 = build(tmp_path / "again", steps=3, batch_size=8, eval_rows=0, verbose=False, carry_drop=0.5)
    assert "greedy_acc" not in m2
    model2, _ = E.load_arith_lm(tmp_path / "again")
    for (n1, p1), (_, p2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(p1, p2), n1


def test_preference_pairs_reject_a_wrong_self_consistent_answer_of_the_models_kinds():
    pairs = E.preference_pairs("train", n=2000, seed=3)
    kinds = {"carry": 0, "sum": 0}
    for p in pairs:
        a, b = E._operands(p["chosen"])
        assert p["chosen"] == E.worked_answer(a, b)
        m = _ANSWER.fullmatch(p["rejected"])
        assert m is not None, p["rejected"]
        ua, ub, u, ta, tb, plus1, t, final = m.groups()
        assert (int(ua), int(ub), int(ta), int(tb)) == (a % 10, b % 10, a // 10, b // 10)
        assert int(final) == int(t) * 10 + int(u) % 10  # self-consistent: the final follows its steps
        assert int(final) != a + b  # and wrong
        carry_right = (bool(plus1) == (a % 10 + b % 10 >= 10))
        kinds["sum" if carry_right else "carry"] += 1
        if carry_right:
            assert int(u) != a % 10 + b % 10 or int(t) != a // 10 + b // 10 + bool(plus1)
    assert abs(kinds["carry"] / len(pairs) - E.CARRY_ERROR_SHARE) < 0.05
    assert E.preference_pairs("train", n=50, seed=3) == pairs[:50]  # deterministic per seed
    test_ops = {E._operands(r["answer"]) for r in E.arithmetic_dataset("test")}
    assert all(E._operands(p["chosen"]) in test_ops for p in E.preference_pairs("test", n=200))


def test_the_demo_package_resolves_the_word_embedded():
    # unialign.embedded.register() adds its data sets and rewards by name; the core loaders know only the names
    import unialign.embedded as demo

    demo.register()
    from unialign.recipes.text import load_pair_data
    from unialign.rewards import REWARDS
    from unialign.text.data import load_rows

    assert demo.ARITH_LM_DIR == E.DEFAULT_ASSET_DIR and (demo.ARITH_LM_DIR / "config.json").is_file()
    assert demo.model_path("embedded") == str(demo.ARITH_LM_DIR) and demo.model_path("org/model") == "org/model"
    # conversational rows (TRL's format), so the policy renders them through the chat template the model knows
    assert load_rows("embedded", "test", n=3) == [{"prompt": [{"role": "user", "content": r["question"]}],
                                                   "answer": r["answer"]} for r in E.arithmetic_dataset("test", n=3)]
    assert {"shape_verifier", "shape_verifier_partial"} <= set(REWARDS)
    cfg = type("Cfg", (), dict(dataset_name="embedded", seed=0, num_eval=4))()
    train, held_out, info = load_pair_data(cfg)
    assert held_out[0]["chosen"] == E.preference_pairs("test", n=4, seed=1)[0]["chosen"]
    assert len(held_out) == 4 and info["eval_source"] == "embedded [test]"
    policy = demo.load_arith_policy(max_new_tokens=4)
    assert Path(policy.model.name_or_path) == demo.ARITH_LM_DIR


@pytest.mark.slow
def test_importing_the_demo_package_registers_nothing_until_register_is_called():
    """Registration is one explicit, idempotent call: importing every module of unialign.embedded leaves the core
    registries as they were; ``register()`` adds the data sets, the shape verifiers and GenEval's backend; a second
    call changes nothing; an entry registered first under the same name is kept."""
    import subprocess
    import sys

    code = """
import importlib, pkgutil
import unialign.embedded as demo
from unialign.rewards.geneval import GENEVAL_BACKENDS
from unialign.rewards.registry import REWARD_INPUTS, REWARDS
from unialign.text.data import NAMED_DATASETS, NAMED_PAIR_DATASETS
for m in pkgutil.iter_modules(demo.__path__):
    importlib.import_module('unialign.embedded.' + m.name)
registries = (REWARDS, REWARD_INPUTS, GENEVAL_BACKENDS, NAMED_DATASETS, NAMED_PAIR_DATASETS)
before = [dict(r) for r in registries]
assert 'embedded' not in NAMED_DATASETS and 'shape_verifier' not in REWARDS and 'shapes' not in GENEVAL_BACKENDS
REWARDS['shape_verifier_partial'] = 'mine:Reward'
demo.register()
assert NAMED_DATASETS['embedded'] is demo._arithmetic_rows and NAMED_PAIR_DATASETS['embedded'] is demo._arithmetic_pairs
assert REWARDS['shape_verifier'] == demo.REWARD_PATHS['shape_verifier'] and REWARD_INPUTS['shape_verifier'] == 'image'
assert REWARDS['shape_verifier_partial'] == 'mine:Reward'  # setdefault: the first registration wins
assert GENEVAL_BACKENDS['shapes'] == demo.GENEVAL_BACKEND_PATHS['shapes']
after = [dict(r) for r in registries]
demo.register()
assert [dict(r) for r in registries] == after != before
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert res.returncode == 0, res.stderr
