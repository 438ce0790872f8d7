"""Each reward function gets its own copy of the batch: a function that edits ``completions``, ``prompts`` or a
column (the list, or a message dict inside it) changes nothing the next function, a retry or the trainer sees."""

from __future__ import annotations

import torch
from PIL import Image

from unialign.rewards import CombinedReward, RewardFunction
from unialign.rewards.base import RewardError, fresh_copy


def test_a_reward_that_edits_its_inputs_changes_nothing_for_the_next():
    seen = []

    def vandal(prompts, completions, answer):
        n = len(completions)
        completions[0][0]["content"] = "hacked"  # inside a message
        completions.append([{"role": "assistant", "content": "extra"}])
        prompts.clear()
        answer[0] = "wrong"
        return [1.0] * n

    def reader(prompts, completions, answer):
        seen.append((prompts, completions, answer))
        return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]

    prompts = [[{"role": "user", "content": "2+2?"}], [{"role": "user", "content": "3+3?"}]]
    completions = [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "6"}]]
    columns = {"answer": ["4", "6"]}
    before = (repr(prompts), repr(completions), repr(columns))
    out = CombinedReward([vandal, reader])(prompts, completions, columns)
    assert out.per_function["reader"].tolist() == [1.0, 1.0]
    got_prompts, got_completions, got_answer = seen[0]
    assert got_prompts == prompts and got_completions == completions and got_answer == ["4", "6"]
    assert (repr(prompts), repr(completions), repr(columns)) == before  # the caller's batch is untouched
    out = CombinedReward([reader, vandal, RewardFunction(reader, name="reader_after")])(prompts, completions, columns)
    assert out.per_function["reader_after"].tolist() == [1.0, 1.0]


def test_images_and_tensors_are_shared_only_the_lists_are_new():
    imgs = [Image.new("RGB", (4, 4), (i, 0, 0)) for i in range(3)]
    latents = [torch.zeros(2) for _ in range(3)]
    got = []

    def grab(prompts, completions, latent):
        got.append((completions, latent))
        completions.pop()
        return [0.0] * 3

    CombinedReward([grab, lambda prompts, completions: [float(len(completions))] * 3])(
        ["a"] * 3, imgs, {"latent": latents})
    completions, latent = got[0]
    assert completions is not imgs and all(a is b for a, b in zip(completions, imgs[:2]))  # no pixel copies
    assert latent is not latents and all(a is b for a, b in zip(latent, latents))
    assert len(imgs) == 3
    assert fresh_copy(["s", 1, None, (1, [2])])[3] == (1, [2])


def test_the_retry_of_a_failed_batch_sees_the_original_samples():
    def flaky(prompts, completions):
        if len(completions) > 1:  # the batch call corrupts its input, then fails
            completions[1] = "bad"
            raise ValueError("batch failed")
        if completions[0] == "bad":
            raise ValueError("saw the corrupted sample")
        return [1.0]

    try:
        CombinedReward([flaky])(["p", "q"], ["a", "b"])
    except RewardError as err:  # every sample alone works: the batch is to blame, not sample 1
        assert "no sample fails alone" in str(err), err
    else:
        raise AssertionError("the failing batch was not reported")


def test_the_trainer_scores_every_reward_on_its_own_samples(tmp_path):
    from tests.trainers.test_online import length_reward, make

    def eraser(prompts, completions):
        n = len(completions)
        completions[:] = [""] * n
        return [0.0] * n

    trainer = make(tmp_path, reward=[eraser, length_reward], max_steps=1)
    traj, _ = trainer.collect()
    lengths = torch.tensor([len(c) / 8.0 for c in traj.completions], dtype=torch.float64)
    assert lengths.sum() > 0
    assert torch.equal(traj.rewards_B, lengths)  # eraser scores 0, length_reward the real completions
