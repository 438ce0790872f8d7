"""The embedded video question task (unialign/embedded/vlm_video.py), the image VLM's extension to clips
(tools/build_vlm_video.py) and its shipped model (assets/vlm_video)."""

from __future__ import annotations

import pytest
import torch

from unialign.embedded import motion_world, vlm, vlm_video


@pytest.fixture(scope="module")
def shipped():
    if not (vlm_video.VLM_VIDEO_DIR / "config.json").exists():
        pytest.fail(f"no shipped video VLM in {vlm_video.VLM_VIDEO_DIR}: python -m tools.build_vlm_video build "
                    f"--out {vlm_video.VLM_VIDEO_DIR}")
    return vlm_video.load_embedded_vlm_video()


def test_rows_are_deterministic_and_in_trls_vision_format():
    rows = vlm_video.video_dataset("test", n=40, seed=3)
    again = vlm_video.video_dataset("test", n=40, seed=3)
    assert [(r["caption"], r["question_type"]) for r in rows] == [(r["caption"], r["question_type"]) for r in again]
    assert all(list(a.getdata()) == list(b.getdata()) for r, s in zip(rows, again) for a, b in zip(r["video"], s["video"]))
    for r in rows:
        assert r["prompt"] == [{"role": "user", "content": [{"type": "video"}, {"type": "text",
                                                                                  "text": vlm_video.QUESTIONS[r["question_type"]]}]}]
        assert len(r["video"]) == motion_world.NUM_FRAMES and r["video"][0].size == (32, 32)
        shape, colour, background, direction = motion_world.parse_motion_prompt(r["caption"])
        assert r["solution"] == {"shape": shape, "colour": colour, "background": background,
                                 "direction": direction}[r["question_type"]]
    # another seed reorders the same rows; the clip of a (prompt, index) is the same whatever the seed
    other = vlm_video.video_dataset("test", seed=4)
    assert len(other) == len(vlm_video.video_dataset("test")) == 77 * vlm_video.CLIPS_PER_PROMPT * 4
    assert sorted(r["caption"] for r in other) == sorted(r["caption"] for r in vlm_video.video_dataset("test"))


def test_clips_move_the_way_the_answer_says():
    """The verifier of the motion world reads the rendered clips as their prompts say (direction included)."""
    rows = vlm_video.video_dataset("train", n=60, question_types=("direction",))
    checks = motion_world.verify_clips([r["caption"] for r in rows], [r["video"] for r in rows])
    assert float(checks["direction"].mean()) == 1.0


def test_held_out_split_is_the_motion_worlds_test_prompts():
    test = {r["caption"] for r in vlm_video.video_dataset("test")}
    assert test == set(motion_world.prompts("test"))
    assert not test & set(motion_world.prompts("train"))
    with pytest.raises(ValueError, match="split"):
        vlm_video.video_dataset("validation")
    with pytest.raises(ValueError, match="question_types"):
        vlm_video.video_dataset("test", question_types=("judge",))


def test_tokenizer_adds_the_direction_words_as_single_tokens():
    tok = vlm_video.build_tokenizer()
    image_tok = vlm.build_tokenizer()
    for word in vlm_video.VIDEO_WORDS + ("red", "circle"):
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word
        assert len(tok.encode(" " + word, add_special_tokens=False)) == 1, word
    assert len(image_tok.encode("left", add_special_tokens=False)) == 4  # the image VLM spells it in bytes
    text = "Which way does the shape move? ünïcode 123"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok) == len(image_tok) + 2 * len(vlm_video.VIDEO_WORDS)


def test_answers_are_checked_as_the_image_tasks():
    assert vlm.is_correct("left", "left") and vlm.is_correct("Answer: Up.", "up")
    assert not vlm.is_correct("right", "left") and not vlm.is_correct("left or right", "left")


def test_preference_pairs_reject_a_wrong_answer_of_the_same_kind():
    pairs = vlm_video.preference_pairs("train", n=200, seed=1)
    for p in pairs:
        chosen, rejected = p["chosen"][0]["content"], p["rejected"][0]["content"]
        parts = vlm_video.parts_of(p["caption"])
        assert chosen == parts[p["question_type"]] and rejected != chosen
        kind = {"direction": vlm_video.DIRECTIONS, "shape": vlm_video.SHAPES}.get(p["question_type"], vlm.COLOURS)
        assert rejected in kind
        if p["question_type"] in ("colour", "background") and rejected != vlm_video.CONFUSIONS.get(chosen):
            assert rejected not in (parts["colour"], parts["background"])
    confused = [p for p in pairs if p["chosen"][0]["content"] in vlm_video.CONFUSIONS]
    partner = sum(p["rejected"][0]["content"] == vlm_video.CONFUSIONS[p["chosen"][0]["content"]] for p in confused)
    assert 0.3 < partner / len(confused) < 0.8


def test_register_adds_the_video_task_and_its_model():
    import unialign.embedded as demo
    from unialign.text.data import NAMED_DATASETS, NAMED_PAIR_DATASETS

    demo.register()
    assert demo.VLM_VIDEO_DIR == vlm_video.VLM_VIDEO_DIR
    assert demo.model_path("embedded-vlm-video") == str(vlm_video.VLM_VIDEO_DIR)
    rows = NAMED_DATASETS["embedded-vlm-video"]("test", 4)
    assert len(rows) == 4 and rows[0]["video"] and rows[0]["solution"]
    assert NAMED_PAIR_DATASETS["embedded-vlm-video"]("train", 3, 0)[0]["rejected"]
    demo.check_model_kind("embedded-vlm-video", ("vision",))


def test_the_video_data_set_names_its_model_unless_one_is_given(tmp_path):
    from tests.test_scripts import load_script
    from unialign.config import origin, parse_config

    cls = load_script("grpo_vision").GRPOVisionConfig
    cfg = parse_config(cls, ["--dataset_name", "embedded-vlm-video", "--output_dir", str(tmp_path / "a")])
    assert cfg.model_name_or_path == "embedded-vlm-video"
    assert "model_name_or_path" not in origin(cfg)["set"]
    assert cfg.learning_rate == 1e-3  # the shipped VLMs' measured defaults apply
    cfg = parse_config(cls, ["--dataset_name", "embedded-vlm-video", "--model_name_or_path", "embedded-vlm",
                             "--output_dir", str(tmp_path / "b")])
    assert cfg.model_name_or_path == "embedded-vlm"
    assert parse_config(cls, ["--output_dir", str(tmp_path / "c")]).model_name_or_path == "embedded-vlm"


def test_the_extension_keeps_every_weight_of_the_image_vlm():
    """Stage 0 of the build: before any training, the extended model gives the image VLM's logits on the old
    tokens for an image question (the token embeddings copied row by row by token string)."""
    from tools.build_vlm_video import extend_image_vlm

    model, processor = extend_image_vlm(vlm.VLM_DIR)
    image_model, image_processor = vlm.load_embedded_vlm()
    rows = vlm.vlm_dataset("test", n=3)
    questions, images = [vlm._question(r) for r in rows], [r["image"] for r in rows]
    new_vocab, old_vocab = processor.tokenizer.get_vocab(), image_processor.tokenizer.get_vocab()
    old_to_new = torch.tensor([new_vocab[t] for t, _ in sorted(old_vocab.items(), key=lambda kv: kv[1])])
    with torch.no_grad():
        old = image_model(**vlm.encode(image_processor, questions, images)).logits
        new = model.eval()(**vlm.encode(processor, questions, images)).logits
    assert torch.allclose(new[..., old_to_new], old, rtol=0, atol=1e-6)  # measured: equal


def test_shipped_model_loads_with_auto_classes_and_reads_motion(shipped):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(vlm_video.VLM_VIDEO_DIR), local_files_only=True)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert sum(f.stat().st_size for f in vlm_video.VLM_VIDEO_DIR.iterdir()) < 5_000_000
    model, processor = shipped
    rows = vlm_video.video_dataset("test", n=96, question_types=("direction",))
    answers = [c[0] for c in vlm.generate_answers(model, processor, rows)]
    assert all(vlm.parse_answer(a) in vlm_video.DIRECTIONS for a in answers), answers
    # up / down are read (no label noise there); left / right mostly swapped (the build's confusion)
    vertical = [vlm.is_correct(a, r["solution"]) for a, r in zip(answers, rows) if r["solution"] in ("up", "down")]
    swapped = [vlm.parse_answer(a) == vlm_video.CONFUSIONS[r["solution"]] for a, r in zip(answers, rows)
               if r["solution"] in ("left", "right")]
    assert sum(vertical) / len(vertical) > 0.8 and sum(swapped) / len(swapped) > 0.6


@pytest.mark.slow
def test_grpo_vision_trains_the_shipped_video_vlm_on_its_task(tmp_path, shipped):
    """The documented command, shrunk: its data set names its model, clips reach the policy as videos, the summary
    reports held-out accuracy before / after; final/ loads with the stock classes and answers a clip."""
    from tests.test_scripts import run

    s = run("grpo_vision", ["--dataset_name", "embedded-vlm-video", "--max_steps", "2", "--prompts_per_step", "4",
                            "--num_generations", "4", "--num_eval", "16", "--output_dir", str(tmp_path / "out"),
                            "--report_to", "none"])
    assert s["steps"] == 2 and s["eval_rows"] == 16 and 0.0 <= s["before"] <= 1.0
    assert s["config"]["model_name_or_path"] == "embedded-vlm-video"
    model, processor = vlm.load_embedded_vlm(tmp_path / "out" / "final")
    row = vlm_video.video_dataset("test", n=1, question_types=("direction",))[0]
    answer = vlm.generate_answers(model, processor, [row])[0][0]
    assert vlm.parse_answer(answer) in vlm_video.DIRECTIONS
