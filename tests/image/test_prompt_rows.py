"""Prompt rows with columns (``.jsonl`` prompt sets, GenEval's metadata format): loading, the checks made before any
model loads, and the columns reaching the reward and the held-out evaluation of an image RL run."""

from __future__ import annotations

import json

import pytest

from unialign.recipes.image import check_reward_rows, load_prompt_rows, split_prompt_rows
from unialign.recipes.presets import GENEVAL_PROMPTS, OCR_PROMPTS


def test_jsonl_rows_keep_their_columns(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a photo of a cat", "tag": "single_object", "include": [{"class": "cat"}]}\n\n'
                    '{"prompt": "a dog", "extra": 3}\n')
    rows = load_prompt_rows(str(path))
    assert rows[1] == {"prompt": "a dog", "extra": 3} and rows[0]["tag"] == "single_object"
    assert [r["prompt"] for r in rows] == ["a photo of a cat", "a dog"]
    for bad, message in (('{"prompt": 3}', r"p\.jsonl:1 needs a non-empty string 'prompt'"),
                         ("not json", r"p\.jsonl:1 is not JSON"), ('["a"]', "needs a non-empty")):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=message):
            load_prompt_rows(str(path))


def test_shipped_example_prompt_files_pass_the_checks():
    rows = load_prompt_rows(GENEVAL_PROMPTS)
    assert {r["tag"] for r in rows} == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    check_reward_rows(["geneval"], rows)
    ocr_rows = load_prompt_rows(OCR_PROMPTS)
    check_reward_rows(["ocr"], ocr_rows)


def test_bad_rows_are_named_before_any_model_loads():
    rows = [{"prompt": "a", "tag": "single_object", "include": [{"class": "cat", "count": 1}]},
            {"prompt": "b", "tag": "single_object", "include": [{"class": "cat", "count": -1}]}]
    with pytest.raises(ValueError, match=r"prompt_set\[1\] \(geneval metadata\): include\[0\].count"):
        check_reward_rows(["geneval"], rows)
    with pytest.raises(ValueError, match=r"prompt_set: ocr: prompt 1 has no quoted target"):
        check_reward_rows(["ocr"], [{"prompt": 'a sign "OPEN"'}, {"prompt": "a sign"}])
    check_reward_rows(["aesthetic"], [{"prompt": "anything"}])
    teal = [{"prompt": "a", "tag": "colors", "include": [{"class": "car", "count": 1, "color": "teal"}]}]
    with pytest.raises(ValueError, match=r"prompt_set\[0\] \(geneval metadata\): include\[0\].color 'teal'"):
        check_reward_rows(["geneval"], teal)
    with pytest.raises(ValueError, match=r"prompt_set\[0\]: the geneval reward needs GenEval metadata"):
        check_reward_rows(["geneval"], [{"prompt": "a photo of a cat"}])
    check_reward_rows(["geneval"], [{"prompt": "a red circle on a blue background"}], geneval_columns=False)


@pytest.mark.slow
def test_embedded_run_with_geneval_rows(tmp_path):
    """The shapes world's prompts as GenEval rows in a .jsonl file: the columns reach the reward (a row asking for
    another colour than its prompt says scores by the row), and the run logs GenEval's strict rate before/after."""
    from tests.test_scripts import load_script
    from unialign.config import parse_config
    from unialign.embedded import shapes_world as E
    from unialign.embedded.geneval_shapes import shapes_metadata

    rows = [{**shapes_metadata(p).as_row()} for p in E.prompts("test")[:4]]
    path = tmp_path / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = load_script("grpo_image")
    argv = ["--model_name_or_path", "embedded-sd3", "--reward", "geneval", "--prompt_set", str(path),
            "--max_steps", "1", "--num_eval", "4", "--prompts_per_step", "1", "--num_generations", "2",
            "--micro_batch_size", "2", "--num_mini_batches", "1", "--output_dir", str(tmp_path / "out"),
            "--report_to", "none", "--save_steps", "0", "--eval_steps", "0"]
    summary = module.main(parse_config(module.GRPOImageConfig, argv, presets=module.PRESETS))
    assert {"geneval/strict_before", "geneval/strict_after", "fidelity_before"} <= set(summary)
    assert summary["geneval/strict_before"] == summary["fidelity_before"]  # the rows say what the prompts say


class _Cfg:
    def __init__(self, prompt_set, eval_prompt_set=None, eval_fraction=0.1):
        self.prompt_set, self.eval_prompt_set, self.eval_fraction = prompt_set, eval_prompt_set, eval_fraction


def test_a_users_prompt_set_is_split_and_held_out_means_held_out(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(20)) + "prompt 3\n")  # a duplicate stays on one side
    train, held_out, source = split_prompt_rows(_Cfg(str(path)))
    assert len({r["prompt"] for r in held_out}) == 2 and not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len(train) + len(held_out) == 21 and source.startswith("held out: 2 of the 20 prompts")
    assert split_prompt_rows(_Cfg(str(path)))[1] == held_out  # the same split every run
    _, held_30, _ = split_prompt_rows(_Cfg(str(path), eval_fraction=0.3))
    assert len(held_30) == 6
    # asked for: evaluate on the training prompts, and say so
    train, held_out, source = split_prompt_rows(_Cfg(str(path), eval_prompt_set="train"))
    assert held_out == train and len(train) == 21 and source.startswith("training prompts") and "not held out" in source
    # a separate held-out file, and one that overlaps the training prompts
    other = tmp_path / "eval.txt"
    other.write_text("new one\nnew two\n")
    train, held_out, source = split_prompt_rows(_Cfg(str(path), eval_prompt_set=str(other)))
    assert len(train) == 21 and [r["prompt"] for r in held_out] == ["new one", "new two"]
    assert source.startswith("held out: eval_prompt_set")
    other.write_text("new one\nprompt 4\n")
    assert "1 of them also train" in split_prompt_rows(_Cfg(str(path), eval_prompt_set=str(other)))[2]
    with pytest.raises(FileNotFoundError, match="eval_prompt_set: 'nope.txt'"):
        split_prompt_rows(_Cfg(str(path), eval_prompt_set="nope.txt"))


def test_a_prompt_set_too_small_to_split_names_the_fix(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("a photo of a cat\na photo of a cat\n")
    with pytest.raises(ValueError, match="1 distinct prompt.*--eval_prompt_set train"):
        split_prompt_rows(_Cfg(str(path)))
    assert split_prompt_rows(_Cfg(str(path), eval_prompt_set="train"))[1] == [{"prompt": "a photo of a cat"}] * 2


def test_a_named_split_is_kept_and_animals_is_split():
    own = ([{"prompt": "a"}], [{"prompt": "b"}])
    assert split_prompt_rows(_Cfg("embedded"), {"embedded": own})[:2] == own
    train, held_out, _ = split_prompt_rows(_Cfg("animals"))
    assert held_out and not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
