"""The embedded vision-language task (unialign/embedded/vlm.py) and its shipped tiny Qwen2-VL (assets/vlm)."""

from __future__ import annotations

import json

import pytest

from unialign.embedded import shapes_world, vlm


@pytest.fixture(scope="module")
def tok_proc():
    tok = vlm.build_tokenizer()
    return tok, vlm.build_processor(tok)


@pytest.fixture(scope="module")
def shipped():
    if not (vlm.VLM_DIR / "config.json").exists():
        pytest.fail(f"no shipped VLM in {vlm.VLM_DIR}: python -m tools.build_vlm build --out {vlm.VLM_DIR}")
    return vlm.load_embedded_vlm()


def test_tokenizer_words_are_single_tokens_and_any_text_round_trips(tok_proc):
    tok, _ = tok_proc
    for word in vlm.SHAPES + vlm.COLOURS + (vlm.YES, vlm.NO):
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word
        assert len(tok.encode(" " + word, add_special_tokens=False)) == 1, word
    question = vlm.judge_question("a red circle on a blue background")
    assert len(tok.encode(question, add_special_tokens=False)) == 13
    for text in ["héllo wörld 123 ✓", "tabs\tand\nnewlines", question]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    for special in vlm.SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(special) < len(tok)
    assert tok.eos_token == vlm.EOS and tok.pad_token == vlm.PAD


def test_chat_template_renders_typed_blocks(tok_proc):
    tok, _ = tok_proc
    messages = vlm.user_message("What shape is it?") + [{"role": "assistant", "content": "circle"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What shape is it?<|im_end|>\n"
                    "<|im_start|>assistant\ncircle<|im_end|>\n")
    prompt = tok.apply_chat_template(vlm.user_message("Hi"), tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_processor_gives_16_image_tokens_per_32px_image(tok_proc):
    tok, proc = tok_proc
    rows = vlm.vlm_dataset("test", n=3)
    enc = vlm.encode(proc, [vlm._question(r) for r in rows], [r["image"] for r in rows])
    image_id = tok.convert_tokens_to_ids(vlm.IMAGE_PAD)
    assert (enc["input_ids"] == image_id).sum(dim=1).tolist() == [vlm.IMAGE_TOKENS] * 3 == [16] * 3
    assert tuple(enc["pixel_values"].shape) == (3 * 64, 96)
    assert enc["image_grid_thw"].tolist() == [[1, 8, 8]] * 3
    assert set(enc) >= {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"}


def test_rows_are_deterministic_and_in_trls_vision_format():
    a, b = vlm.vlm_dataset("test", n=40, seed=3), vlm.vlm_dataset("test", n=40, seed=3)
    assert [(r["solution"], r["question_type"], r["caption"]) for r in a] == \
        [(r["solution"], r["question_type"], r["caption"]) for r in b]
    assert all(x["image"].tobytes() == y["image"].tobytes() for x, y in zip(a, b))
    assert len(vlm.vlm_dataset("test")) == 18 * vlm.IMAGES_PER_CAPTION * 3
    for row in a:
        assert set(row) == {"prompt", "image", "solution", "question_type", "caption"}
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"][0] == {"type": "image"}
        assert message["content"][1]["type"] == "text"
        assert row["image"].size == (32, 32) and row["image"].mode == "RGB"
        shape, colour, background = vlm._caption_parts(row["caption"])
        assert row["solution"] == {"colour": colour, "shape": shape, "background": background}[row["question_type"]]
        assert vlm._question(row) == vlm.QUESTIONS[row["question_type"]]
    other = vlm.vlm_dataset("test", n=40, seed=4)  # another order, the same rows
    key = sorted((r["caption"], r["question_type"], r["image"].tobytes()) for r in vlm.vlm_dataset("test"))
    assert [r["caption"] for r in other] != [r["caption"] for r in a]
    assert key == sorted((r["caption"], r["question_type"], r["image"].tobytes()) for r in vlm.vlm_dataset("test", seed=4))


def test_judge_rows_and_wording():
    assert vlm.judge_question("a red circle on a blue background") == \
        "Does this image show: a red circle on a blue background?"
    rows = vlm.vlm_dataset("test", question_types=("judge",))
    assert {r["solution"] for r in rows} == {"yes", "no"} and sum(r["solution"] == "yes" for r in rows) * 2 == len(rows)
    for r in rows:
        asked = vlm._question(r)[len("Does this image show: "):-1]
        if r["solution"] == "yes":
            assert asked == r["caption"]
        else:  # one attribute changed
            assert sum(x != y for x, y in zip(asked.split(), r["caption"].split())) == 1


def test_held_out_split_is_the_shapes_worlds_test_captions():
    train = {r["caption"] for r in vlm.vlm_dataset("train")}
    test = {r["caption"] for r in vlm.vlm_dataset("test")}
    assert test == set(shapes_world.prompts("test")) and train == set(shapes_world.prompts("train"))
    assert not train & test
    with pytest.raises(ValueError):
        vlm.vlm_dataset("validation")


@pytest.mark.parametrize("completion, ok", [
    ("red", True), (" Red.\n", True), ("Answer: red", True), ("I think so. Answer: red", True),
    ([{"role": "assistant", "content": "red"}], True), ([{"role": "assistant", "content": [{"type": "text", "text": "red"}]}], True),
    ("blue", False), ("red blue", False), ("Answer: blue", False), ("", False), ("redd", False),
    ([{"role": "assistant", "content": "orange"}], False), (None, False),
])
def test_is_correct(completion, ok):
    assert vlm.is_correct(completion, "red") is ok


def test_accuracy_reward_has_trls_signature():
    completions = ["circle", [{"role": "assistant", "content": "square"}], "Answer: triangle"]
    assert vlm.accuracy_reward(prompts=[None] * 3, completions=completions,
                               solution=["circle", "circle", "triangle"], question_type=["shape"] * 3) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError):
        vlm.accuracy_reward(["red"], ["red", "blue"])


def test_preference_pairs():
    pairs = vlm.preference_pairs("test", n=30, seed=1)
    again = vlm.preference_pairs("test", n=30, seed=1)
    assert [(p["chosen"], p["rejected"], p["caption"]) for p in pairs] == \
        [(p["chosen"], p["rejected"], p["caption"]) for p in again]
    for p in pairs:
        assert {"prompt", "image", "chosen", "rejected"} <= set(p)
        chosen, rejected = p["chosen"][0]["content"], p["rejected"][0]["content"]
        assert p["chosen"][0]["role"] == p["rejected"][0]["role"] == "assistant"
        row = {"shape": vlm.SHAPES, "colour": vlm.COLOURS, "background": vlm.COLOURS}[p["question_type"]]
        assert chosen in row and rejected in row and chosen != rejected
        assert vlm.is_correct(p["chosen"], chosen) and not vlm.is_correct(p["rejected"], chosen)


def test_export_writes_jsonl_and_pngs(tmp_path):
    from PIL import Image

    paths = vlm.export(tmp_path, n_train=5, n_test=4)
    for split, n in (("train", 5), ("test", 4)):
        rows = [json.loads(line) for line in paths[split].read_text().splitlines()]
        assert len(rows) == n
        for i, row in enumerate(rows):
            assert row["image"] == f"images/{split}_{i:05d}.png"
            image = Image.open(paths[split].parent / row["image"])
            assert image.size == (32, 32)
            assert row["prompt"][0]["content"][0] == {"type": "image"} and row["solution"]
    first = vlm.vlm_dataset("train", n=1)[0]
    saved = Image.open(tmp_path / "images" / "train_00000.png").convert("RGB")
    assert saved.tobytes() == first["image"].tobytes()


def test_cli_export(tmp_path, capsys):
    assert vlm.main(["export", "--out", str(tmp_path), "--n-train", "2", "--n-test", "2", "--judge"]) == 0
    assert "train: 2 rows" in capsys.readouterr().out
    assert (tmp_path / "test.jsonl").exists() and (tmp_path / "images" / "test_00001.png").exists()


def test_register_adds_the_vlm_task():
    import unialign.embedded as demo
    from unialign.rewards.registry import REWARD_INPUTS, REWARDS, resolve
    from unialign.text.data import NAMED_DATASETS, NAMED_PAIR_DATASETS

    demo.register()
    assert demo.VLM_DIR == vlm.VLM_DIR and demo.model_path("embedded-vlm") == str(vlm.VLM_DIR)
    assert resolve(REWARDS["vlm_accuracy"]) is vlm.accuracy_reward and REWARD_INPUTS["vlm_accuracy"] == "text"
    rows = NAMED_DATASETS["embedded-vlm"]("test", 4)
    assert len(rows) == 4 and rows[0]["solution"]
    pairs = NAMED_PAIR_DATASETS["embedded-vlm"]("train", 3, 0)
    assert len(pairs) == 3 and pairs[0]["chosen"]


def test_load_names_the_rebuild_command_when_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="tools.build_vlm build"):
        vlm.load_embedded_vlm(tmp_path)


def test_build_model_ids_are_in_the_vocabulary(tok_proc):
    tok, _ = tok_proc
    model = vlm.build_model(tok, hidden=32, heads=2, kv_heads=1, intermediate=64, vision_dim=32)
    cfg, n = model.config, len(tok)
    for value in (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
                  cfg.text_config.bos_token_id, cfg.text_config.eos_token_id, cfg.text_config.pad_token_id):
        assert value is not None and 0 <= value < n
    assert cfg.text_config.vocab_size == n


def test_shipped_model_loads_with_auto_classes_and_answers_in_form(shipped):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(vlm.VLM_DIR), local_files_only=True)
    processor = AutoProcessor.from_pretrained(str(vlm.VLM_DIR), local_files_only=True)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert sum(f.stat().st_size for f in vlm.VLM_DIR.iterdir()) < 5_000_000
    rows = vlm.vlm_dataset("test", n=12)
    answers = [c[0] for c in vlm.generate_answers(model, processor, rows)]
    words = set(vlm.SHAPES + vlm.COLOURS)
    assert all(vlm.parse_answer(a) in words for a in answers), answers
    model2, proc2 = shipped
    with torch.no_grad():
        enc = vlm.encode(proc2, [vlm._question(r) for r in rows[:2]], [r["image"] for r in rows[:2]])
        assert torch.equal(model(**enc).logits, model2(**enc).logits)


def test_shipped_judge_scores(shipped):
    """The shipped judge is weak (BUILD.md: AUC 0.64) but reads the images: on the held-out judge rows its P(yes)
    is higher for the images' own captions than for captions with one attribute changed."""
    model, processor = shipped
    rows = vlm.vlm_dataset("test", question_types=("judge",))
    questions = [vlm._question(r)[len("Does this image show: "):-1] for r in rows]
    scores = vlm.judge_scores(model, processor, [r["image"] for r in rows], questions)
    assert len(scores) == len(rows) == 144 and all(0.0 <= s <= 1.0 for s in scores)
    pos = [s for s, r in zip(scores, rows) if r["solution"] == "yes"]
    neg = [s for s, r in zip(scores, rows) if r["solution"] == "no"]
    assert sum(pos) / len(pos) > sum(neg) / len(neg) + 0.08  # measured 0.512 vs 0.381
