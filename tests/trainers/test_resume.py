"""Safe, honest resume: no unpickling, a refused resume on changed settings, `latest` with nothing to resume."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from tests.trainers.test_online import ROWS, make
from tests.trainers.test_preference import PAIRS, config
from unialign.config import exit_on_user_error
from unialign.text.policy import CausalLMPolicy
from unialign.trainers import finish_run
from unialign.trainers.checkpoint import CHECKSUM_FILE, file_digests, read_trainer_state
from unialign.trainers.preference import DPOObjective, PreferenceTrainer
from unialign.trainers.resume import data_fingerprint


class Payload:
    """Unpickling this creates ``path``: proof that code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def reseal(ckpt):
    """Rewrite a checkpoint's checksums to match its files: what a crafted checkpoint's author would do, so the
    loaders' own refusal to unpickle is tested, not only the checksum."""
    (ckpt / CHECKSUM_FILE).write_text(json.dumps({"algorithm": "sha256", "files": file_digests(ckpt)}))


def trained(tmp_path, **kw):
    trainer = make(tmp_path, max_steps=2, **kw)
    trainer.train()
    return trainer


def test_trainer_state_is_plain_json_and_round_trips_nan(tmp_path):
    trainer = trained(tmp_path)
    ckpt = tmp_path / "checkpoint-2"
    assert not (ckpt / "trainer_state.pt").exists()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["settings"]["learning_rate"] == 1e-2
    assert state["settings"]["dataset_fingerprint"] == data_fingerprint(ROWS)
    trainer.history[0]["probe"] = float("nan")
    trainer.save_checkpoint()
    back = read_trainer_state(ckpt)["history"][0]["probe"]
    assert back != back  # NaN restored as NaN


@pytest.mark.parametrize("where", ["trainer_state.pt", "optimizer.bin"])
def test_a_crafted_checkpoint_cannot_run_code(tmp_path, where):
    trained(tmp_path)
    ckpt = tmp_path / "checkpoint-2"
    marker = tmp_path / "pwned"
    if where == "trainer_state.pt":  # an old-style state file carrying a payload (and no JSON one)
        (ckpt / "trainer_state.json").unlink()
        with open(ckpt / where, "wb") as f:
            pickle.dump({"step": 2, "history": [Payload(marker)]}, f)
    else:
        torch.save({"state": {}, "param_groups": [], "x": Payload(marker)}, ckpt / where)
    reseal(ckpt)
    with pytest.raises(ValueError, match="refusing to load"):
        make(tmp_path, max_steps=4, resume_from_checkpoint="latest").train()
    assert not marker.exists()


@pytest.mark.parametrize("content", ["payload", "garbage", "no torch state"])
def test_an_unreadable_rng_state_is_refused_not_skipped(tmp_path, content):
    """accelerate reads its RNG file with weights_only=True and, when that fails, goes on without it (the resume
    would not be bit-identical): the resume refuses it instead, naming it, and runs no code."""
    trained(tmp_path)
    marker = tmp_path / "pwned"
    path = tmp_path / "checkpoint-2" / "random_states_0.pkl"
    if content == "payload":
        with open(path, "wb") as f:
            pickle.dump({"random_state": Payload(marker)}, f)
    elif content == "garbage":
        path.write_bytes(b"not a pickle")
    else:
        torch.save({"random_state": (3, tuple(range(625)), None)}, path)
    reseal(tmp_path / "checkpoint-2")
    resumed = make(tmp_path, max_steps=3, resume_from_checkpoint="latest")
    with pytest.raises(ValueError, match="random_states_0.pkl: (refusing to load it|holds no)"):
        resumed.train()
    assert not marker.exists()


def test_latest_with_no_checkpoint_is_a_user_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        make(tmp_path, resume_from_checkpoint="latest")
    assert exit_info.value.code == 2
    assert "no checkpoint to resume" in capsys.readouterr().err


def test_changed_settings_are_refused_with_a_diff(tmp_path):
    trained(tmp_path)
    with pytest.raises(ValueError) as err:
        make(tmp_path, max_steps=4, resume_from_checkpoint="latest", learning_rate=1e-3, num_generations=2,
             algorithm="dr_grpo", rows=ROWS[:-1])
    msg = str(err.value)
    for line in ("learning_rate: 0.01 (checkpoint) -> 0.001 (now)", "num_generations: 4 (checkpoint) -> 2 (now)",
                 "algorithm: 'grpo' (checkpoint) -> 'dr_grpo' (now)", "scale_rewards: 'group'", "dataset_fingerprint:",
                 "--allow_config_change"):
        assert line in msg, (line, msg)
    assert "max_steps" not in msg  # a constant schedule does not depend on it
    make(tmp_path / "cos", max_steps=2, lr_scheduler_type="cosine").train()
    with pytest.raises(ValueError, match="max_steps: 2 .checkpoint. -> 4"):
        make(tmp_path / "cos", max_steps=4, lr_scheduler_type="cosine", resume_from_checkpoint="latest")


def test_allowed_change_trains_with_the_new_lr_and_the_summary_records_both(tmp_path):
    trained(tmp_path, weight_decay=0.0)
    resumed = make(tmp_path, max_steps=3, resume_from_checkpoint="latest", learning_rate=1e-3, weight_decay=0.1,
                   allow_config_change=True)
    resumed.train()
    group = resumed.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-3) and group["weight_decay"] == 0.1
    assert resumed.history[-1]["lr"] == pytest.approx(1e-3)
    summary = finish_run(resumed.acc, resumed.cfg, {"steps": resumed.step}, lambda path: None)
    changes = {c["field"]: (c["old"], c["new"], c["step"]) for c in summary["config_changes_on_resume"]}
    assert changes == {"learning_rate": (1e-2, 1e-3, 2), "weight_decay": (0.0, 0.1, 2)}
    assert json.loads((tmp_path / "summary.json").read_text())["config_changes_on_resume"]


def test_preference_trainer_resume_is_checked_too(tmp_path):
    def trainer(**kw):
        from tests.conftest import make_tiny_lm

        model, tok = make_tiny_lm()
        objective = DPOObjective(CausalLMPolicy(model, tok, max_new_tokens=4), beta=kw.pop("beta", 0.1))
        return PreferenceTrainer(objective, kw.pop("rows", PAIRS), config(tmp_path, **kw))

    trainer(max_steps=1).train()
    assert (tmp_path / "checkpoint-1" / "trainer_state.json").exists()
    with pytest.raises(ValueError, match=r"(?s)batch_size: 8 \(checkpoint\) -> 4.*beta: 0.1 \(checkpoint\) -> 0.5"):
        trainer(max_steps=2, beta=0.5, batch_size=4, resume_from_checkpoint="latest")
    with pytest.raises(ValueError, match="dataset_fingerprint"):
        trainer(max_steps=2, rows=PAIRS[1:], resume_from_checkpoint="latest")
    resumed = trainer(max_steps=2, resume_from_checkpoint="latest")
    resumed.train()
    assert resumed.step == 2 and len(resumed.history) == 2


def test_the_same_local_model_by_a_relative_or_an_absolute_path_is_one_model(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from unialign.trainers.resume import resume_settings, same_place

    (tmp_path / "my_model").mkdir()
    monkeypatch.chdir(tmp_path)
    base = dict(learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
                weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, seed=0)
    rel = resume_settings(SimpleNamespace(**base, model_name_or_path="my_model"), [])
    absolute = resume_settings(SimpleNamespace(**base, model_name_or_path=str(tmp_path / "my_model")), [])
    dotted = resume_settings(SimpleNamespace(**base, model_name_or_path="./my_model/"), [])
    assert rel == absolute == dotted
    assert same_place("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"  # a Hub id as given
    assert same_place("other_model") == "other_model"  # no such folder here: as given, still different
