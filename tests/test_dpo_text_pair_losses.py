"""scripts/dpo_text.py --algorithm simpo / orpo: two-step runs that never ask for a reference, and the pair-loss
flags checked before any model loads."""

from __future__ import annotations

import math

import pytest

from tests.test_scripts import check_summary, run, run_cli
from unialign.text import CausalLMPolicy

SMOKE = ["--max_steps", "2", "--num_eval", "16", "--batch_size", "8", "--micro_batch_size", "4", "--report_to", "none"]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["simpo", "orpo"])
def test_reference_free_algorithms_two_steps(tmp_path, monkeypatch, algorithm):
    def no_reference(self):
        raise AssertionError("a reference-free algorithm asked for a reference")

    monkeypatch.setattr(CausalLMPolicy, "reference", no_reference)
    run("dpo_text", SMOKE + ["--algorithm", algorithm, "--precompute_ref_log_probs", "true",
                             "--output_dir", str(tmp_path)])
    s = check_summary(tmp_path, "accuracy")
    assert s["pair_loss"] == algorithm and math.isfinite(s["first_loss"])
    if algorithm == "orpo":  # the chosen NLL is part of ORPO's loss: L_SFT + 0.1 * L_OR, L_OR > 0
        assert s["first_loss"] > s["first_nll_loss"] > 0 and s["beta"] == 0.1 and s["rpo_alpha"] == 1.0
    else:  # SimPO's beta / gamma plus the chosen NLL at weight 2 (the embedded default): L = L_SimPO + 2 NLL
        assert (s["beta"], s["simpo_gamma"], s["rpo_alpha"]) == (2.0, 0.5, 2.0)
        assert s["first_loss"] > 2 * s["first_nll_loss"] > 0
    assert not list(tmp_path.glob("ref_cache-*.safetensors"))  # nothing to precompute without a reference


@pytest.mark.parametrize("argv, message", [
    (["--simpo_gamma", "1.0"], "--simpo_gamma: applies to --algorithm simpo, not dpo"),
    (["--algorithm", "orpo", "--loss_type", "ipo"], "--loss_type: chooses the DPO variant of --algorithm dpo"),
    (["--algorithm", "simpo", "--label_smoothing", "0.1"], "label_smoothing applies to"),
    (["--algorithm", "kto"], "--algorithm: 'kto' is not one of dpo, vrpo, simpo, orpo"),
])
def test_pair_loss_flags_fail_before_the_model_loads(tmp_path, monkeypatch, capsys, argv, message):
    def no_load(*a, **k):
        raise AssertionError("the model loaded before the flags were checked")

    monkeypatch.setattr(CausalLMPolicy, "from_pretrained", no_load)
    code, line = run_cli("dpo_text", argv + ["--output_dir", str(tmp_path)], capsys)
    assert code == 2 and message in line, (argv, line)
