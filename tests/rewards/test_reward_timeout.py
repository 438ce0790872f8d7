"""``--reward_timeout``: a reward call that never returns is stopped and named (reward, limit, step) within
seconds -- raised, or with ``reward_errors="skip"`` scored as reward errors -- while the call itself runs in the
main thread as without a limit (libraries timing themselves with ``signal.alarm`` keep working)."""

from __future__ import annotations

import math
import signal
import threading
import time

import pytest

from unialign.rewards import CombinedReward
from unialign.rewards.base import DEFAULT_REWARD_TIMEOUT_S, RewardError, RewardTimeoutError
from unialign.rewards.deadline import CallTimedOut, call_with_deadline


def fast(prompts, completions):
    return [float(len(c)) for c in completions]


def sleepy(prompts, completions):
    time.sleep(10**6)


def stubborn(prompts, completions):
    """Busy Python work that swallows every ordinary exception."""
    while True:
        try:
            sum(range(1000))
        except Exception:  # noqa: BLE001 - the point: a reward's own error handling cannot keep it running
            pass


@pytest.mark.parametrize("fn", [sleepy, stubborn])
def test_a_reward_that_never_returns_is_stopped_and_named(fn):
    reward = CombinedReward([fast, fn], timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RewardTimeoutError, match=rf"reward function '{fn.__name__}' did not return within 0.5 s at "
                                                 rf"step 3 on a batch of 2 completions \(stopped at "
                                                 rf"test_reward_timeout.py:\d+ in {fn.__name__}\); raise "
                                                 r"--reward_timeout \(0: no limit\), or pass --reward_errors skip"):
        reward(["p", "q"], ["a", "bb"], step=3)
    assert time.monotonic() - start < 5
    time.sleep(0.3)  # no stray interruption afterwards
    assert CombinedReward([fast], timeout_s=0.5)(["p"], ["abc"]).per_function["fast"].tolist() == [3.0]


def test_skip_scores_the_stalled_batch_as_reward_errors():
    out = CombinedReward([fast, sleepy], on_error="skip", timeout_s=0.3)(["p", "q", "r"], ["a", "bb", "c"])
    assert out.per_function["fast"].tolist() == [1.0, 2.0, 1.0]
    assert all(math.isnan(x) for x in out.per_function["sleepy"].tolist())
    assert out.num_errors == 3 and out.errors_per_function == {"fast": 0, "sleepy": 3}
    assert all(math.isnan(x) for x in out.rewards_B.tolist())


def test_the_call_runs_in_the_main_thread_so_signal_based_libraries_work():
    def uses_alarm(prompts, completions):  # what math-verify does around its parser
        assert threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGALRM, lambda *a: None)
        signal.alarm(5)
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        return [1.0] * len(completions)

    assert CombinedReward([uses_alarm], timeout_s=2)(["p"], ["a"]).rewards_B.tolist() == [1.0]


def test_math_verify_rewards_keep_their_own_timeouts():
    math_verify = pytest.importorskip("math_verify")

    def accuracy(prompts, completions, solution):  # TRL's accuracy_reward, in short
        return [float(math_verify.verify(math_verify.parse(s), math_verify.parse(c))) for c, s in zip(completions, solution)]

    out = CombinedReward([accuracy], timeout_s=30)(["p", "q"], ["$4$", "$5$"], {"solution": ["$4$", "$4$"]})
    assert out.rewards_B.tolist() == [1.0, 0.0]


def test_off_the_main_thread_a_stalled_call_is_abandoned():
    release = threading.Event()
    result = {}

    def worker():
        try:
            call_with_deadline(lambda: release.wait(60), 0.3)
        except CallTimedOut as err:
            result["err"] = err

    t = threading.Thread(target=worker)
    start = time.monotonic()
    t.start()
    t.join(10)
    release.set()
    assert time.monotonic() - start < 5
    assert result["err"].abandoned and "abandoned: it still runs in a background thread" in str(result["err"])
    assert call_with_deadline(lambda: 7, None) == 7 and call_with_deadline(lambda: 8, 1.0) == 8


def test_the_trainer_names_the_step_and_keeps_the_steps_before(tmp_path):
    from tests.conftest import make_tiny_lm
    from tests.trainers.test_online import ROWS
    from unialign.text.policy import CausalLMPolicy
    from unialign.trainers import OnlineConfig, OnlineTrainer

    calls = []

    def hangs_at_step_2(prompts, completions):
        calls.append(len(completions))
        if len(calls) == 2:
            time.sleep(10**6)
        return [len(c) / 8.0 for c in completions]

    cfg = OnlineConfig(num_generations=4, prompts_per_step=2, micro_batch_size=4, max_steps=3, report_to="none",
              output_dir=str(tmp_path), learning_rate=1e-2, beta=0.0, reward_timeout=0.5)
    model, tok = make_tiny_lm()
    trainer = OnlineTrainer(CausalLMPolicy(model, tok, max_new_tokens=8), hangs_at_step_2, ROWS, cfg)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"'hangs_at_step_2' did not return within 0.5 s at step 2 on a batch of 8 "
                                          r"completions .*steps 1-1 are saved in .*checkpoint-1"):
        trainer.train()
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_reward_timeout_is_a_flag_of_the_online_scripts(tmp_path):
    from tests.test_config import script_config
    from unialign.config import UserError, parse_config

    for name in ("grpo_math", "ppo_rlhf", "grpo_image", "ddpo_aesthetic"):
        _, cls = script_config(name)
        out = ["--output_dir", str(tmp_path / name)]
        assert parse_config(cls, out).reward_timeout == DEFAULT_REWARD_TIMEOUT_S == 600.0
        assert parse_config(cls, ["--reward_timeout", "0", *out]).reward_timeout == 0.0
        assert parse_config(cls, ["--reward_timeout", "none", *out]).reward_timeout is None
        with pytest.raises(UserError, match="--reward_timeout: must be >= 0.0, got -1.0"):
            parse_config(cls, ["--reward_timeout", "-1", *out])


def test_a_result_returned_after_the_limit_is_discarded():
    """A reward that catches the stop (``except BaseException``) and returns late: its result is not used."""
    def catches_everything(prompts, completions):
        try:
            time.sleep(10**6)
        except BaseException:  # noqa: BLE001 - the point
            pass
        return [99.0] * len(completions)

    with pytest.raises(RewardTimeoutError, match="did not return within 0.5 s .*its return, after the limit"):
        CombinedReward([catches_everything], timeout_s=0.5)(["p"], ["c"])
    out = CombinedReward([catches_everything], timeout_s=0.5, on_error="skip")(["p"], ["c"])
    assert math.isnan(out.rewards_B[0]) and out.num_errors == 1


def test_a_reward_calling_sys_exit_is_a_reward_error_not_the_end_of_the_run():
    def quits(prompts, completions):
        raise SystemExit(0)

    with pytest.raises(RewardError, match=r"reward function 'quits' raised RewardExit .*it called sys.exit\(0\)"):
        CombinedReward([quits])(["p"], ["c"])
    out = CombinedReward([quits], on_error="skip")(["p", "q"], ["c", "d"])
    assert out.rewards_B.isnan().all() and out.num_errors == 2


UNSTOPPABLE = """import re, sys, time
from unialign.rewards import CombinedReward

def regex(prompts, completions):  # catastrophic backtracking in C: holds the GIL, no signal handler runs
    return [float(bool(re.match(r"(a+)+$", "a" * 40 + "b")))]

def stubborn(prompts, completions):  # catches the stop, every time it comes
    while True:
        try:
            time.sleep(10**6)
        except BaseException:
            pass

CombinedReward([{"regex": regex, "stubborn": stubborn}[sys.argv[1]]], timeout_s=1.0)(["p"], ["c"])
print("never reached")
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["regex", "stubborn"])
def test_a_reward_nothing_in_the_process_can_stop_ends_the_run_with_one_line(kind):
    import subprocess
    import sys

    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", UNSTOPPABLE, kind], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == -signal.SIGKILL and "never reached" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: reward function {kind!r} did not stop within 5 s after its 1 s limit (it holds the interpreter in "
        "C code, e.g. a catastrophic regex, or catches the stop), so the run was killed; its last checkpoint is "
        "whole: fix or bound the call, then --resume_from_checkpoint latest")
    assert took < 30  # 1 s limit + 5 s to unwind, plus the interpreter's start
