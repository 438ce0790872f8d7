"""A model of the wrong kind, or a misspelt shipped model, is one line naming what is wrong and the fix (exit 2),
before any data or model loads -- not a Hub, prompt-set or loader error about something else."""

from __future__ import annotations

import json

import pytest

from tests.test_scripts import load_script


def _exit_line(script: str, argv: list[str], tmp_path, capsys) -> str:
    from unialign.config import exit_on_user_error, parse_config

    module = load_script(script)
    cls = next(v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
               and v.__module__ == module.__name__)
    with pytest.raises(SystemExit) as info, exit_on_user_error():
        extra = [] if "--output_dir" in argv else ["--output_dir", str(tmp_path / "out")]
        module.main(parse_config(cls, argv + extra, presets=module.PRESETS))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def folders(tmp_path):
    """A text LM's, a VLM's and a diffusers pipeline's folders, as their configs say (no weights needed)."""
    text, vlm, pipe = tmp_path / "text_lm", tmp_path / "vlm", tmp_path / "pipe"
    for folder in (text, vlm, pipe):
        folder.mkdir()
    (text / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (vlm / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    return {"text": str(text), "vision": str(vlm), "image": str(pipe)}


@pytest.mark.parametrize("script,model,expected", [
    ("grpo_math", "embeded", "(did you mean 'embedded'?)"),
    ("grpo_math", "embedded-sd3", "'embedded-sd3' is the shipped image (diffusers) model; this script trains text "
                                  "models"),
    ("grpo_image", "embedded-sd4", "(did you mean 'embedded-sd3'?)"),
    ("ddpo_aesthetic", "embedded-vlm", "is the shipped vision-language model; this script trains image"),
    ("grpo_vision", "embedded", "'embedded' is the shipped text model; this script trains vision-language models"),
    ("dpo_sdxl", "embedded-mdlm", "is the shipped text model; this script trains image"),
    ("train_reward_model", "embedded-sd3", "scripts/grpo_image.py"),
])
def test_shipped_models_of_another_kind_and_typos(tmp_path, capsys, script, model, expected):
    line = _exit_line(script, ["--model_name_or_path", model], tmp_path, capsys)
    assert expected in line, line


@pytest.mark.parametrize("script,kind,expected", [
    ("grpo_vision", "text", "is a text model (its config.json says so); this script trains vision-language models"),
    ("grpo_image", "text", "is a text model (its config.json says so); this script trains image (diffusers) models"),
    ("dpo_sdxl", "vision", "is a vision-language model"),
    ("grpo_math", "image", "is an image (diffusers) model (its model_index.json says so)"),
])
def test_a_local_folder_of_another_kind_is_named(tmp_path, capsys, folders, script, kind, expected):
    line = _exit_line(script, ["--model_name_or_path", folders[kind]], tmp_path, capsys)
    assert expected in line and "scripts/" in line, line


def test_the_right_kind_passes_the_check(folders):
    from unialign.embedded import check_model_kind

    check_model_kind(folders["text"], ("text",))
    check_model_kind(folders["vision"], ("text", "vision"))  # dpo_text trains both
    check_model_kind(folders["image"], ("image",))
    check_model_kind("Qwen/Qwen2.5-0.5B-Instruct", ("text",))  # a Hub id: the loader's check (offline: one line)
    check_model_kind("gpt2", ("text",))  # a bare Hub id far from every shipped name


def test_geneval_prompts_on_the_embedded_model_say_which_backend_reads_what(tmp_path, capsys):
    from unialign.recipes.presets import GENEVAL_PROMPTS

    line = _exit_line("grpo_image", ["--reward_funcs", "geneval", "--prompt_set", GENEVAL_PROMPTS], tmp_path, capsys)
    assert "cannot parse prompt 'a photo of a bench'" in line and "its pixel detector, 'shapes'" in line
    assert "--preset sd3.5-medium-geneval" in line, line


def test_a_refused_run_leaves_no_empty_output_directory(tmp_path, capsys):
    out = tmp_path / "new" / "run"
    _exit_line("grpo_math", ["--model_name_or_path", "embedded-sd3", "--output_dir", str(out)], tmp_path, capsys)
    assert not (tmp_path / "new").exists()  # both folders it made are gone
    (tmp_path / "kept").mkdir()
    _exit_line("grpo_math", ["--model_name_or_path", "embeded", "--output_dir", str(tmp_path / "kept")], tmp_path,
               capsys)
    assert (tmp_path / "kept").is_dir()  # a folder the user had stays


def test_a_local_folder_that_does_not_load_is_named_as_one(tmp_path, capsys, folders):
    """A folder of the right kind whose weights are missing: one line about the folder, not about the network."""
    line = _exit_line("grpo_math", ["--model_name_or_path", folders["text"]], tmp_path, capsys)
    assert f"could not load the local folder {folders['text']!r}" in line and "offline" not in line, line
