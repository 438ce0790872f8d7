"""The vision-language entry points on TRL-format folders: grpo_vision (GRPO, PPO), dpo_text on image pairs, the
checks that run before any model loads, the offline preset."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.test_scripts import load_script, run
from tests.vision.tiny import build, random_image


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm")
    model, processor = build("qwen2_vl")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _data(folder, n_train: int = 12, n_test: int = 4, pairs: bool = False):
    """A folder of TRL vision rows: messages + an image path relative to the file, ``<image>`` strings with
    ``images``, a text-only row; ``solution`` (or chosen / rejected) columns."""
    rng = random.Random(0)
    (folder / "images").mkdir(parents=True)
    for split, n in (("train", n_train), ("test", n_test)):
        rows = []
        for i in range(n):
            path = f"images/{split}_{i}.png"
            random_image(rng).save(folder / path)
            if i % 4 == 3:
                row = {"prompt": "no image, answer 'a'"}
            elif i % 2:
                row = {"prompt": "Look: <image> colour?", "images": [path]}
            else:
                row = {"prompt": [{"role": "user", "content": "Colour?"}], "image": path}
            row.update({"chosen": "a", "rejected": "bb"} if pairs else {"solution": "a"})
            rows.append(row)
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


REWARD_SOURCE = ("def has(completions, solution, **kwargs):\n"
                 "    return [float(s in c) + 0.1 * len(c) for c, s in zip(completions, solution)]\n")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_grpo_vision_on_a_folder_of_trl_rows(tmp_path, user_module, vlm_dir, algorithm):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    data = _data(tmp_path / "data")
    out = tmp_path / "out"
    s = run("grpo_vision", ["--model_name_or_path", str(vlm_dir), "--dataset_name", str(data), "--algorithm", algorithm,
                            "--reward_funcs", user_module("vrewards", REWARD_SOURCE) + ":has", "--max_steps", "2",
                            "--prompts_per_step", "2", "--num_generations", "2", "--output_dir", str(out),
                            "--report_to", "none"])
    assert s["steps"] == 2 and (s["train_rows"], s["eval_rows"]) == (12, 4)
    AutoModelForImageTextToText.from_pretrained(str(out / "final"))
    AutoProcessor.from_pretrained(str(out / "final"))
    first = json.loads((out / "completions.jsonl").read_text().splitlines()[0])
    assert "<image 32x" in json.dumps(first["prompt"]) or "<image 40x" in json.dumps(first["prompt"]) \
        or "<image 48x" in json.dumps(first["prompt"])


@pytest.mark.parametrize("freeze", [None, "false"])
def test_dpo_text_trains_a_vlm_on_image_pairs(tmp_path, vlm_dir, freeze):
    """The language model trains; the vision tower stays as it was unless ``--freeze_vision false``."""
    from safetensors.torch import load_file

    data = _data(tmp_path / "pairs", pairs=True)
    out = tmp_path / "out"
    s = run("dpo_text", ["--model_name_or_path", str(vlm_dir), "--dataset_name", str(data), "--max_steps", "2",
                         "--batch_size", "4", "--micro_batch_size", "2", "--learning_rate", "1e-2",
                         "--output_dir", str(out), "--report_to", "none"]
            + (["--freeze_vision", freeze] if freeze else []))
    assert s["metric"] == "implicit_accuracy" and s["steps"] == 2 and s["eval_rows"] == 4
    assert s["config"]["freeze_vision"] is (freeze is None)
    before, after = load_file(str(vlm_dir / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    tower = {k for k in before if "visual" in k}
    assert tower and changed - tower  # the language model moved
    assert bool(changed & tower) is (freeze == "false")  # the tower moved only when asked to train


def _exit_line(argv, capsys) -> str:
    from unialign.config import exit_on_user_error, parse_config

    module = load_script("grpo_vision")
    with pytest.raises(SystemExit) as info, exit_on_user_error():
        module.main(parse_config(module.GRPOVisionConfig, argv, presets=module.PRESETS))
    assert info.value.code == 2
    return capsys.readouterr().err.strip()


def test_bad_rows_are_refused_naming_the_row_before_any_model_loads(tmp_path, capsys):
    data = _data(tmp_path / "data")
    rows = (data / "train.jsonl").read_text().splitlines()
    rows[5] = json.dumps({"prompt": "two <image> and <image>", "images": ["images/train_0.png"], "solution": "a"})
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    line = _exit_line(["--model_name_or_path", str(tmp_path / "no_model"), "--dataset_name", str(data)], capsys)
    assert "row 5: the prompt has 2 image placeholder(s) but the row has 1 image(s)" in line, line
    rows[5] = json.dumps({"prompt": "x", "image": "images/missing.png", "solution": "a"})
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    line = _exit_line(["--model_name_or_path", str(tmp_path / "no_model"), "--dataset_name", str(data)], capsys)
    assert "row 5: field 'image': no image file at 'images/missing.png'" in line, line


def test_prompt_limits_count_image_tokens_before_any_forward(tmp_path, capsys, vlm_dir):
    data = _data(tmp_path / "data")  # a 32x32 image is 16 image tokens here; the template adds ~20 more
    line = _exit_line(["--model_name_or_path", str(vlm_dir), "--dataset_name", str(data), "--reward_funcs",
                       "math_accuracy", "--max_prompt_length", "24"], capsys)
    assert "rows are too long (row 0: prompt has" in line and "--max_prompt_length" in line, line


def test_geometry3k_preset_fails_fast_offline(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = _exit_line(["--preset", "qwen2.5-vl-3b-geometry3k"], capsys)
    assert "hiyouga/geometry3k" in line


def test_trl_signature_with_a_processor_and_an_image_column(tmp_path):
    """TRL's VLM call: a loaded model, ``processing_class=processor``, a ``datasets.Dataset`` with ``prompt``
    messages and a decoded ``image`` column; and DPO on RLAIF-V-style pairs."""
    from datasets import Dataset, Features, Image, Value

    from unialign import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, VisionLanguagePolicy

    rng = random.Random(0)
    images = [random_image(rng) for _ in range(8)]
    features = Features({"prompt": [{"role": Value("string"), "content": Value("string")}], "image": Image(),
                         "solution": Value("string")})
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Colour?"}]] * 8, "image": images,
                              "solution": ["a"] * 8}, features=features)
    model, processor = build("qwen2_vl")
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=1, learning_rate=1e-3, report_to="none")
    trainer = GRPOTrainer(model=model, processing_class=processor, args=args, train_dataset=data,
                          reward_funcs=lambda completions, solution, **kw: [float(len(c)) for c in completions])
    assert isinstance(trainer.policy, VisionLanguagePolicy)
    assert trainer.train().global_step == 1
    pairs = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Colour?"}]] * 4, "image": images[:4],
                               "chosen": ["a"] * 4, "rejected": ["b"] * 4},
                              features=Features({**{k: features[k] for k in ("prompt", "image")},
                                                 "chosen": Value("string"), "rejected": Value("string")}))
    dpo = DPOTrainer(model=model, processing_class=processor, train_dataset=pairs,
                     args=DPOConfig(output_dir=str(tmp_path / "dpo"), per_device_train_batch_size=2, max_steps=1,
                                    report_to="none"))
    assert isinstance(dpo.policy, VisionLanguagePolicy) and dpo.train().global_step == 1


def test_prompt_column_is_read_as_the_prompt_before_rows_are_checked(tmp_path, capsys):
    """geometry3k's schema (``problem``, not ``prompt``) with ``--prompt_column problem``: the rows load, in TRL's
    format, images attached; a column that is not there is one line naming the flag, the row and the columns."""
    from unialign.config import parse_config
    from unialign.recipes.text import load_prompt_data
    from unialign.recipes.vision import with_images

    data = _data(tmp_path / "data")
    for split in ("train", "test"):
        path = data / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({"problem" if k == "prompt" else k: v for k, v in r.items()}) + "\n"
                                for r in rows))
    module = load_script("grpo_vision")
    cfg = parse_config(module.GRPOVisionConfig, ["--dataset_name", str(data), "--prompt_column", "problem",
                                                 "--output_dir", str(tmp_path / "out")])
    train, held_out, _ = load_prompt_data(cfg)
    train = with_images(train, cfg, "train")
    assert len(train) == 12 and all("prompt" in r and "problem" not in r for r in train)
    assert train[3]["prompt"] == "no image, answer 'a'" and held_out[0]["solution"] == "a"
    line = _exit_line(["--dataset_name", str(data), "--prompt_column", "question_text",
                       "--output_dir", str(tmp_path / "out2")], capsys)
    assert "--prompt_column 'question_text'" in line and "row 0 has no such column" in line and "'problem'" in line


def _video_data(folder, pairs: bool = False):
    """TRL-style rows with ``video`` (frame paths relative to the file) / ``videos`` (a ``<video>`` string), an image
    row and a text-only row."""
    rng = random.Random(1)
    (folder / "frames").mkdir(parents=True)
    for split, n in (("train", 8), ("test", 4)):
        rows = []
        for i in range(n):
            clip = []
            for k in range(3):
                path = f"frames/{split}_{i}_{k}.png"
                random_image(rng, (32, 32)).save(folder / path)
                clip.append(path)
            if i % 4 == 3:
                row = {"prompt": "no media, answer 'a'"}
            elif i % 4 == 2:
                row = {"prompt": [{"role": "user", "content": "Colour?"}], "image": clip[0]}
            elif i % 2:
                row = {"prompt": "Which way does it move: <video>?", "videos": [clip]}
            else:
                row = {"prompt": [{"role": "user", "content": "Which way?"}], "video": clip}
            row.update({"chosen": "a", "rejected": "bb"} if pairs else {"solution": "a"})
            rows.append(row)
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_dpo_text_trains_a_vlm_on_video_pairs(tmp_path, vlm_dir):
    data = _video_data(tmp_path / "pairs", pairs=True)
    s = run("dpo_text", ["--model_name_or_path", str(vlm_dir), "--dataset_name", str(data), "--max_steps", "2",
                         "--batch_size", "4", "--micro_batch_size", "2", "--learning_rate", "1e-2", "--max_frames", "2",
                         "--output_dir", str(tmp_path / "out"), "--report_to", "none"])
    assert s["steps"] == 2 and s["eval_rows"] == 4 and s["config"]["max_frames"] == 2


@pytest.mark.slow
def test_grpo_vision_on_video_rows(tmp_path, user_module, vlm_dir):
    data = _video_data(tmp_path / "data")
    s = run("grpo_vision", ["--model_name_or_path", str(vlm_dir), "--dataset_name", str(data), "--reward_funcs",
                            user_module("vrewards_video", REWARD_SOURCE) + ":has", "--max_steps", "2",
                            "--prompts_per_step", "2", "--num_generations", "2", "--output_dir", str(tmp_path / "out"),
                            "--report_to", "none"])
    assert s["steps"] == 2 and (s["train_rows"], s["eval_rows"]) == (8, 4)


def test_a_bad_video_row_is_refused_naming_it_before_any_model_loads(tmp_path, capsys):
    data = _video_data(tmp_path / "data")
    rows = (data / "train.jsonl").read_text().splitlines()
    rows[1] = json.dumps({"prompt": "<video> and <video>?", "videos": [["frames/train_0_0.png"]], "solution": "a"})
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    line = _exit_line(["--model_name_or_path", str(tmp_path / "no_model"), "--dataset_name", str(data)], capsys)
    assert "row 1: the prompt has 2 video placeholder(s) but the row has 1 video(s)" in line, line
