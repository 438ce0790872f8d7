"""The ``vlm_judge`` reward (unialign/rewards/vlm_judge.py) on the tiny random Qwen2-VL of tests/vision/tiny.py,
saved with save_pretrained and loaded back by path: P(yes) against a plain forward, batched against one by one,
the score parser, the offline failure, the yes / no words, the metrics and the command-line route."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from unialign.rewards import get_reward
from unialign.rewards.vlm_judge import (
    ENV_VAR,
    JUDGE_MODELS,
    VLMJudgeReward,
    parse_final_score,
    yes_no_token_ids,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest on the busy 2-core box

PROMPTS = ["a cat", "a big red dog on a blue background", "x", "two green triangles above a circle", "a"]


def tiny_vlm_judge(root) -> dict[str, str]:
    """``VLMJudgeReward`` kwargs (model_name_or_path) of tests/vision/tiny.py's random Qwen2-VL, saved with
    save_pretrained (safetensors) and its processor under ``root``."""
    from tests.vision.tiny import build

    model, processor = build("qwen2_vl")
    model.save_pretrained(root)
    processor.save_pretrained(root)
    return {"model_name_or_path": str(root), "device": "cpu"}


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return tiny_vlm_judge(tmp_path_factory.mktemp("tiny_qwen2_vl"))["model_name_or_path"]


@pytest.fixture(scope="module")
def judge(judge_dir):
    return VLMJudgeReward(judge_dir, device="cpu", batch_size=len(PROMPTS))


@pytest.fixture(scope="module")
def images():
    from tests.vision.tiny import random_image

    rng = random.Random(0)
    return [random_image(rng) for _ in PROMPTS]  # sizes differ: different numbers of image tokens per row


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def _plain_next_token_probs(judge_dir, prompt, image):
    """softmax of the full next-token logits of a plain forward (model and processor loaded on their own)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(judge_dir).eval()
    processor = AutoProcessor.from_pretrained(judge_dir)
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": f"Does this image show: {prompt}?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with torch.no_grad():
        logits = model(**processor(text=[text], images=[image], return_tensors="pt")).logits[0, -1]
    return torch.softmax(logits.double(), -1), processor.tokenizer


def test_p_yes_equals_a_plain_forward(judge_dir, judge, images):
    probs, tok = _plain_next_token_probs(judge_dir, PROMPTS[1], images[1])
    ids = tok.convert_tokens_to_ids
    # one word per side: the two-token ratio P(Yes) / (P(Yes) + P(No))
    two = VLMJudgeReward(judge_dir, yes_words=["Yes"], no_words=["No"], model=judge.model, processor=judge.processor)
    assert (two.yes_ids, two.no_ids) == ([ids("Y")], [ids("N")])  # a character tokenizer: the first characters
    expected = probs[ids("Y")] / (probs[ids("Y")] + probs[ids("N")])
    assert two([PROMPTS[1]], [images[1]])[0] == pytest.approx(float(expected), abs=1e-6)
    # the default words: "Yes" / "yes" -> Y, y; " yes" / " no" share the space: dropped from both sides
    assert (judge.yes_ids, judge.no_ids) == ([ids("Y"), ids("y")], [ids("N"), ids("n")])
    p_yes, p_no = probs[ids("Y")] + probs[ids("y")], probs[ids("N")] + probs[ids("n")]
    out = judge([PROMPTS[1]], [images[1]])
    assert out[0] == pytest.approx(float(p_yes / (p_yes + p_no)), abs=1e-6)
    assert out.metrics["yes_no_mass"] == pytest.approx(float(p_yes + p_no), abs=1e-6)


def test_batched_equals_one_by_one_under_left_padding(judge_dir, judge, images):
    batched = judge(PROMPTS, images)
    assert judge.tokenizer.padding_side == "left" and len(batched) == len(PROMPTS)
    single = VLMJudgeReward(judge_dir, batch_size=1, model=judge.model, processor=judge.processor)
    one_by_one = [single([p], [im])[0] for p, im in zip(PROMPTS, images)]
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    assert single(PROMPTS, images) == pytest.approx(one_by_one, abs=1e-5)  # batches of 1 through one call
    assert all(0.0 < r < 1.0 for r in batched) and len(set(batched)) > 1
    # a float tensor [B,3,H,W] in [0, 1] is taken as the other image rewards take it (rounded to 8 bits)
    from unialign.rewards.image import to_pil_images

    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert judge(PROMPTS[:2], x) == pytest.approx(judge(PROMPTS[:2], to_pil_images(x)), abs=0)
    with pytest.raises(ValueError, match="2 prompts for 5 images"):
        judge(PROMPTS[:2], images)


@pytest.mark.parametrize("text, expected", [
    ("Final Score: 4", 0.8),
    ("The image matches well.\nFinal Score: 4.5", 0.9),
    ("final score: 5.0", 1.0),           # the label is matched case-insensitively (the default)
    ("FINAL SCORE:3", 0.6),
    ("Final Score: 2. The dog is missing.", 0.4),   # a sentence's full stop is not a decimal
    ("Final Score: 5.5", 1.0),           # 5.5 / 5 clamped to 1
    ("Final Score: 3 ... Final Score: 5", 0.6),     # the first one, as Flow-GRPO's re.search
    ("no score", None),
    ("", None),
    ("Final Score: 7", None),            # outside 1..5: not matched
    ("Final Score: 0", None),
    ("Final Score: 10", None),           # not read as 1 (Flow-GRPO's regex would)
    ("Score: 4", None),
])
def test_parse_final_score(text, expected):
    got = parse_final_score(text)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_parse_final_score_case_sensitive_is_flow_grpos_rule():
    assert parse_final_score("final score: 5.0", case_sensitive=True) is None
    assert parse_final_score("Final Score: 5.0", case_sensitive=True) == 1.0


def test_score_mode_scores_the_answers_and_counts_the_unparsed(judge_dir, judge, images, monkeypatch):
    scorer = VLMJudgeReward(judge_dir, mode="score", max_new_tokens=4, batch_size=2, model=judge.model,
                            processor=judge.processor)
    assert "Final Score:" in scorer.question and "{prompt}" in scorer.question  # Flow-GRPO's UnifiedReward prompt
    answers = scorer.answers(PROMPTS, images)  # the tiny random model's greedy answers: no score in them
    assert len(answers) == len(PROMPTS) and answers == VLMJudgeReward(
        judge_dir, mode="score", max_new_tokens=4, batch_size=1, model=judge.model,
        processor=judge.processor).answers(PROMPTS, images)
    out = scorer(PROMPTS, images)
    assert list(out) == [0.0] * 5 and out.metrics == {"unparsed": 5.0, "unparsed_rate": 1.0}
    canned = ["Final Score: 4", "final score: 5.0", "no score", "Final Score: 7", "Final Score: 1"]
    monkeypatch.setattr(scorer, "answers", lambda prompts, images: canned[:len(prompts)])
    out = scorer(PROMPTS, images)
    assert out == pytest.approx([0.8, 1.0, 0.0, 0.0, 0.2]) and out.metrics == {"unparsed": 2.0, "unparsed_rate": 0.4}
    # through the reward contract the metrics are logged as vlm_judge/<name>
    from unialign.rewards import CombinedReward
    from unialign.rewards.base import RewardFunction

    combined = CombinedReward([RewardFunction(scorer, name="vlm_judge")])(PROMPTS, images)
    assert combined.metrics()["rewards/vlm_judge/unparsed"] == 2.0


def test_offline_hub_id_fails_within_seconds(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot load the model 'nobody/no-such-judge-vlm': HF_HUB_OFFLINE is set"):
        VLMJudgeReward("nobody/no-such-judge-vlm")
    assert time.monotonic() - start < 5
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        VLMJudgeReward("./no/such/judge/folder")


def test_a_tokenizer_without_the_words_raises_naming_them(judge_dir, judge):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    digits = Tokenizer(models.WordLevel(vocab={"<unk>": 0, **{str(i): i + 1 for i in range(10)}}, unk_token="<unk>"))
    digits.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=digits, unk_token="<unk>")
    with pytest.raises(ValueError, match=r"no token for any of the yes words \['Yes', 'yes', ' Yes', ' yes'\]"):
        yes_no_token_ids(tok)
    with pytest.raises(ValueError, match=r"no words \['ñ', '¿'\]"):
        VLMJudgeReward(judge_dir, no_words=["ñ", "¿"], model=judge.model, processor=judge.processor)
    with pytest.raises(ValueError, match=r"yes words \[' '\]"):  # shared with " no": dropped from both sides
        VLMJudgeReward(judge_dir, yes_words=[" "], no_words=[" no"], model=judge.model, processor=judge.processor)


class _DictTokenizer:
    """A stand-in tokenizer: whole words of ``vocab`` are one token, anything else its characters (unknown: 0)."""

    unk_token_id = 0

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = {w: i for i, w in enumerate(["<unk>", *vocab])}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        if text in self.vocab:
            return {"input_ids": [self.vocab[text]]}
        return {"input_ids": [self.vocab.get(c, 0) for c in text]}


def test_single_token_words_are_preferred_to_first_pieces():
    # a BPE-like vocabulary with "yes" / " yes" / "no" / " no" as words and bytes for the rest ("Yes" -> Y e s)
    tok = _DictTokenizer(["yes", " yes", "no", " no", "Y", "e", "s", "N", "o", " "])
    v = tok.vocab
    assert yes_no_token_ids(tok) == ([v["yes"], v[" yes"]], [v["no"], v[" no"]])  # not the byte "Y" of "Yes"
    chars = _DictTokenizer(["Y", "e", "s", "y", "N", "o", "n", " "])  # no word is one token: first pieces
    v = chars.vocab
    assert yes_no_token_ids(chars) == ([v["Y"], v["y"]], [v["N"], v["n"]])  # " " is on both sides: dropped


def test_the_command_line_route_by_environment_and_by_name(judge_dir, judge, images, monkeypatch):
    # --reward_funcs vlm_judge builds the class with no arguments: the variable names the judge
    monkeypatch.setenv(ENV_VAR, judge_dir)
    reward = get_reward("vlm_judge")
    assert reward.name == "vlm_judge" and reward.fn.model_name_or_path == judge_dir
    assert reward(PROMPTS[:2], images[:2]) == pytest.approx(judge(PROMPTS[:2], images[:2]), abs=1e-6)
    monkeypatch.setenv(ENV_VAR, json.dumps({"model_name_or_path": judge_dir, "mode": "score", "max_new_tokens": 3}))
    scorer = VLMJudgeReward(batch_size=3)
    assert (scorer.mode, scorer.max_new_tokens, scorer.batch_size) == ("score", 3, 3)
    monkeypatch.setenv(ENV_VAR, '{"model_name_or_path": "x", "modes": "score"}')
    with pytest.raises(ValueError, match=r"unknown arguments \['modes'\]"):
        VLMJudgeReward()
    # a short name other packages register: its arguments, beneath the explicit ones
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setitem(JUDGE_MODELS, "tiny-judge", {"model_name_or_path": judge_dir, "question": "Is it {prompt}?"})
    named = VLMJudgeReward("tiny-judge", batch_size=2)
    assert (named.model_name_or_path, named.question, named.batch_size) == (judge_dir, "Is it {prompt}?", 2)
    assert "Is it a cat?" in named.render("a cat")
    assert VLMJudgeReward("tiny-judge", question="Q {prompt}", model=judge.model,
                          processor=judge.processor).question == "Q {prompt}"


def test_bad_arguments_are_refused_before_loading():
    with pytest.raises(ValueError, match="mode must be one of"):
        VLMJudgeReward("unused", mode="rank")
    with pytest.raises(ValueError, match="must contain '{prompt}'"):
        VLMJudgeReward("unused", question="Is this good?")
    with pytest.raises(ValueError, match="torch_dtype"):
        VLMJudgeReward("unused", torch_dtype="int8")


def test_videos_are_judged_as_a_plain_video_forward(judge_dir, judge):
    from tests.vision.tiny import random_image

    rng = random.Random(5)
    clips = [[random_image(rng, (32, 32)) for _ in range(k)] for k in (2, 4)]
    got = judge(PROMPTS[:2], clips)
    assert len(got) == 2 and all(0.0 < r < 1.0 for r in got)
    # a plain forward of the processor's own video inputs, one clip at a time
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(judge_dir).eval()
    processor = AutoProcessor.from_pretrained(judge_dir)
    ids = processor.tokenizer.convert_tokens_to_ids
    for prompt, clip, value in zip(PROMPTS[:2], clips, got):
        messages = [{"role": "user", "content": [{"type": "video"},
                                                 {"type": "text", "text": f"Does this video show: {prompt}?"}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        with torch.no_grad():
            logits = model(**processor(text=[text], videos=[clip], return_tensors="pt")).logits[0, -1].double()
        p = torch.softmax(logits, -1)
        yes, no = p[ids("Y")] + p[ids("y")], p[ids("N")] + p[ids("n")]
        assert value == pytest.approx(float(yes / (yes + no)), abs=1e-5)
    with pytest.raises(ValueError, match="2 prompts for 1 videos"):
        judge(PROMPTS[:2], clips[:1])
