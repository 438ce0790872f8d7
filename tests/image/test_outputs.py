"""What an image run leaves for its user: ``final/`` of a full fine-tune is a whole diffusers pipeline
folder that stock ``DiffusionPipeline.from_pretrained`` loads with the trained denoiser (every family, and a real
short run of the script on the embedded model); one ``comparison.png`` (before | after per held-out prompt, a
legend, readable captions, at most 32 prompts) named in ``summary.json``; Diffusion-DPO on a user's own pairs
reports implicit accuracy on those pairs and shows their captions, without printing row ids; a hub model with the
scripts' default prompt set is refused naming ``--prompt_set`` before anything loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.test_scripts import load_script

pytestmark = pytest.mark.usefixtures("one_thread")



def script_config(name: str, argv: list[str]):
    from unialign.config import parse_config

    module = load_script(name)
    cfg_cls = next(v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
                   and v.__module__ == module.__name__)
    return module, parse_config(cfg_cls, argv, presets=module.PRESETS)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


# ---------------------------------------------------------------- 1. final/ of a full fine-tune is a pipeline
def tiny_policy(kind: str, make_policy, tokenizer_dir):
    if kind in ("sd", "sdxl"):
        return make_policy(kind, seed=3)
    if kind == "sd3":
        from tests.image.test_flow_policy import sd3_components
        from unialign.image.flow_policy import FlowMatchingPolicy

        return FlowMatchingPolicy(**sd3_components(tokenizer_dir, 3), num_steps=2, max_sequence_length=6)
    from tests.image.test_flux_policy import FLUX_DEFAULTS, flux_components
    from unialign.image.flux_policy import FluxPolicy

    return FluxPolicy(**flux_components(tokenizer_dir, 3), **FLUX_DEFAULTS)


@pytest.mark.parametrize("kind", ["sd", "sdxl", "sd3", "flux"])
def test_a_full_fine_tune_saves_a_pipeline_stock_diffusers_loads(make_policy, tokenizer_dir, tmp_path, kind):
    """``save`` without LoRA: a folder ``DiffusionPipeline.from_pretrained`` (through the snippet the run prints)
    and the family's own pipeline class load, holding the changed denoiser and the run's other parts."""
    from diffusers import DiffusionPipeline

    policy = tiny_policy(kind, make_policy, tokenizer_dir)
    with torch.no_grad():
        for p in policy.denoiser.parameters():
            p.add_(0.01)  # weights no source folder has
    policy.save(str(tmp_path))
    snippet = policy.load_snippet(str(tmp_path))
    assert len(snippet.splitlines()) == 3 and "DiffusionPipeline.from_pretrained" in snippet
    # the run's sampling settings are recorded and passed: the stock defaults would sample something else
    settings = json.loads((tmp_path / "sampling.json").read_text())
    assert settings == policy.sampling_settings() and settings["num_inference_steps"] == policy.num_steps
    assert all(f"{k}={v!r}" in snippet.splitlines()[2] for k, v in settings.items())
    scope: dict = {}
    exec("\n".join(snippet.splitlines()[:2]), scope)  # what the run prints and final/README.md says: the load
    pipe = scope["pipe"]
    cls = policy._pipeline_class()
    assert type(pipe) is cls and same_weights(getattr(pipe, policy.denoiser_subfolder), policy.denoiser)
    assert same_weights(pipe.vae, policy.vae) and same_weights(pipe.text_encoder, policy.text_encoder)
    assert type(pipe.scheduler) is type(policy.scheduler)
    assert (tmp_path / policy.denoiser_subfolder / "diffusion_pytorch_model.safetensors").is_file()
    assert snippet.splitlines()[1].replace(str(tmp_path), "path/to/this/folder") in (tmp_path / "README.md").read_text()
    own = cls.from_pretrained(str(tmp_path), **{n: None for n in policy._absent_components()})
    assert same_weights(getattr(own, policy.denoiser_subfolder), policy.denoiser)
    if kind == "sd":  # no safety checker was loaded: none is asked for
        assert own.safety_checker is None and not own.config.requires_safety_checker
    if kind == "sdxl":
        assert own.config.force_zeros_for_empty_prompt == policy.force_zeros_for_empty_prompt
    if kind == "sd3":  # the policy had no T5: the folder has none either, as the snippet says
        assert policy._absent_components() == ["text_encoder_3", "tokenizer_3"] and "text_encoder_3=None" in snippet
        with pytest.raises(ValueError, match="text_encoder_3"):
            DiffusionPipeline.from_pretrained(str(tmp_path))  # stock diffusers' own rule for SD3 without T5


def test_a_lora_save_is_unchanged(make_policy, tmp_path):
    """LoRA: only ``pytorch_lora_weights.safetensors`` (``load_lora_weights``), and the snippet names the base."""
    policy = make_policy("sdxl", lora_rank=2)
    policy.save(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pytorch_lora_weights.safetensors", "sampling.json"]
    snippet = policy.load_snippet(str(tmp_path), "org/base")
    assert "StableDiffusionXLPipeline.from_pretrained('org/base')" in snippet and "load_lora_weights" in snippet
    assert "num_inference_steps=" in snippet.splitlines()[-1]


@pytest.mark.slow
def test_grpo_image_full_fine_tune_final_is_a_pipeline_with_the_trained_unet(tmp_path, capsys):
    """A real short run (embedded SDXL model, full UNet): ``final/`` loads with stock diffusers, holds the trained
    UNet (changed from the embedded one), samples finite images; ``comparison.png`` replaces the two grids."""
    from diffusers import DiffusionPipeline

    from unialign.embedded import parts, register, shapes_world
    from unialign.recipes.image import run_image_rl

    register()  # the shape verifier by name, as the script's main registers it
    out = tmp_path / "run"
    _, cfg = script_config("grpo_image", [
        "--max_steps", "1", "--num_eval", "4", "--prompts_per_step", "2", "--num_generations", "4",
        "--micro_batch_size", "8", "--num_steps", "4", "--learning_rate", "1e-3", "--output_dir", str(out),
        "--report_to", "none"])
    run_parts = parts.image_rl_parts(cfg)  # what the script's main does, keeping the policy to compare with
    summary = run_image_rl(cfg, **run_parts)
    trained = run_parts["policy"].denoiser
    printed = capsys.readouterr().out
    assert f"DiffusionPipeline.from_pretrained({str((out / 'final').resolve())!r})" in printed
    pipe = DiffusionPipeline.from_pretrained(str(out / "final"))
    base = DiffusionPipeline.from_pretrained(str(shapes_world.pipeline_dir()))
    assert type(pipe).__name__ == "StableDiffusionXLPipeline" and same_weights(pipe.unet, trained)
    assert not same_weights(base.unet, trained)  # it trained
    assert same_weights(pipe.vae, base.vae) and same_weights(pipe.text_encoder_2, base.text_encoder_2)
    images = pipe(["a red circle on a blue background"], num_inference_steps=2, guidance_scale=1.0, height=32,
                  width=32, output_type="np").images
    assert images.shape == (1, 32, 32, 3) and np.isfinite(images).all()
    assert summary["comparison_image"] == str(out / "comparison.png")
    assert json.loads((out / "summary.json").read_text())["comparison_image"] == summary["comparison_image"]
    assert Image.open(out / "comparison.png").width > 4 * 2 * 192 - 1
    assert not (out / "grid_before.png").exists() and not (out / "grid_after.png").exists()


# ---------------------------------------------------------------- 2. one before/after comparison image
def solid(colour) -> Image.Image:
    return Image.new("RGB", (32, 32), colour)


def test_comparison_pairs_before_and_after_of_each_prompt_side_by_side():
    from unialign.image.grid import first_of_each_prompt, make_comparison

    prompts = [f"prompt {i}" for i in range(3)] * 2  # held-out prompts cycled over 6 images
    before = [solid((200, 0, 0))] * 6
    after = [solid((0, 0, 200))] * 6
    image = make_comparison(before, after, prompts, ["0.100 ok"] * 6, ["0.900 x"] * 6, title="run: reward",
                            columns=2, cell=64)
    assert first_of_each_prompt(prompts) == [0, 1, 2]
    pair_w, gutter = 2 * (64 + 4), 10
    assert image.width == 2 * (pair_w + gutter)  # two pairs to a row
    px = np.asarray(image)
    red = np.where((px[:, 34] == (200, 0, 0)).all(axis=1))[0]
    top, second = red[0], red[red > red[0] + 64][0]  # the first rows of the two rows of pairs
    assert top > 2 * 16 and (px[:top - 2] < 128).any()  # a header above them: title and before / after legend
    for y, pairs in ((top, 2), (second, 1)):  # three prompts: two pairs, then one
        for col in range(2):
            x0 = col * (pair_w + gutter)
            if col < pairs:  # before (red) left of after (blue)
                assert tuple(px[y + 32, x0 + 34]) == (200, 0, 0) and tuple(px[y + 32, x0 + 68 + 34]) == (0, 0, 200)
            else:
                assert (px[y:, x0:] == 255).all()
    assert (px[top + 64 + 2:second - 2, 0:pair_w] < 128).any()  # a caption between the rows


def test_comparison_captions_are_readable_and_at_most_32_prompts():
    from unialign.image.grid import MAX_COMPARISON_PROMPTS, _line_height, caption_font, make_comparison

    font = caption_font()
    height = font.getbbox("Ag")[3] - font.getbbox("Ag")[1]
    assert height >= 12 and _line_height(font) >= 16  # the default bitmap font is ~7 px (11 a line)
    prompts = [f"a long prompt number {i} with several words that need wrapping onto lines" for i in range(40)]
    images = [solid((i, i, i)) for i in range(40)]
    image = make_comparison(images, images, prompts, cell=64)
    rows = -(-MAX_COMPARISON_PROMPTS // 4)
    assert MAX_COMPARISON_PROMPTS == 32 and image.width == 4 * (2 * 68 + 10)
    assert image.height < (rows + 1) * (68 + 6 * _line_height(font) + 10)  # 8 rows of pairs, not 10
    assert image.height > rows * (68 + 10)
    with pytest.raises(ValueError, match="2 before / 1 after"):
        make_comparison(images[:2], images[:1], prompts[:2])


def test_make_grid_keeps_its_layout_for_other_callers(tmp_path):
    """``make_grid`` / ``save_grid`` (the trackers' held-out grid, benchmarks/p11_forward.py's figure) as before:
    8 tiles of ``cell`` px to a row, captions in 11 px lines under them."""
    from unialign.image.grid import save_grid

    grid = save_grid([solid((9, 9, 9))] * 10, ["a cat"] * 10, tmp_path / "g.png", cell=64)
    assert grid.size == (8 * 64, 2 * (64 + 11 + 4)) and Image.open(tmp_path / "g.png").size == grid.size


def test_held_out_labels_and_the_saved_comparison(tmp_path):
    from unialign.image.evaluate import HeldOutImages

    evaluator = HeldOutImages(None, ["a", "b"], 0)
    res = {"images": [solid((1, 2, 3))] * 2, "scores": torch.tensor([0.25, 0.5]),
           "fidelity_flags": torch.tensor([1.0, 0.0])}
    assert evaluator.labels(res) == ["0.250 ok", "0.500 x"]
    evaluator.last = res
    assert evaluator.captions() == ["a | 0.250 | ok", "b | 0.500 | x"]
    path = evaluator.save_comparison(tmp_path / "sub" / "comparison.png", res, res, "t")
    assert path.is_file() and Image.open(path).width == 2 * (2 * 196 + 10)


# ---------------------------------------------------------------- 3. Diffusion-DPO on a user's own pairs
@pytest.mark.slow
def test_dpo_sdxl_on_own_pairs_reports_their_implicit_accuracy_and_captions(tmp_path, capsys, monkeypatch):
    from unialign.image import grid

    data = tmp_path / "pairs"
    (data / "img").mkdir(parents=True)
    for i, colour in enumerate([(200, 30, 30), (30, 30, 200), (30, 200, 30), (200, 200, 30)]):
        Image.new("RGB", (32, 32), colour).save(data / "img" / f"{i}.png")
    captions = [f"my own caption number {i}" for i in range(20)]
    rows = [{"caption": captions[i], "jpg_0": f"img/{i % 4}.png", "jpg_1": f"img/{(i + 1) % 4}.png",
             "label_0": i % 2} for i in range(20)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shown: list[list[str]] = []
    real = grid.make_comparison
    monkeypatch.setattr(grid, "make_comparison", lambda b, a, prompts, *args, **kw: (
        shown.append(list(prompts)), real(b, a, prompts, *args, **kw))[1])
    module, cfg = script_config("dpo_sdxl", [
        "--dataset_name", str(data), "--eval_fraction", "0.2", "--max_steps", "1", "--batch_size", "4",
        "--micro_batch_size", "4", "--eval_timestep_samples", "1", "--output_dir", str(tmp_path / "out"),
        "--report_to", "none"])
    summary = module.main(cfg)
    printed = capsys.readouterr().out
    assert summary["metric"] == "implicit_accuracy" and summary["num_eval_pairs"] == 4
    assert summary["before"] == summary["implicit_accuracy_before"] == 0.5  # policy == reference before training
    assert summary["after"] == summary["implicit_accuracy_after"] and 0.0 <= summary["after"] <= 1.0
    assert not {"gold_before", "gold_after", "fidelity_before", "fidelity_after"} & set(summary)
    assert "row_ids" not in summary and "row_ids" not in printed
    assert "row_ids" not in json.loads((tmp_path / "out" / "summary.json").read_text())
    assert len(shown) == 1 and len(shown[0]) == 4 and set(shown[0]) <= set(captions)  # the held-out captions
    assert summary["comparison_image"] == str(tmp_path / "out" / "comparison.png")
    assert (tmp_path / "out" / "comparison.png").is_file()
    assert (tmp_path / "out" / "final" / "model_index.json").is_file()


# ---------------------------------------------------------------- 4. a hub model needs --prompt_set
@pytest.mark.parametrize("script", ["grpo_image", "ddpo_aesthetic"])
def test_a_hub_model_with_the_default_prompt_set_is_told_to_pass_one(tmp_path, capsys, monkeypatch, script):
    from unialign.config import exit_on_user_error
    from unialign.image.policy import DiffusionPolicy
    from unialign.recipes import image as recipe

    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded before the prompt set was refused")

    monkeypatch.setattr(recipe, "load_denoiser", no_load)
    monkeypatch.setattr(DiffusionPolicy, "from_pretrained", no_load)
    monkeypatch.setattr(recipe, "get_reward", no_load)
    folder = tmp_path / "my_model"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    for model, extra, expected in (("someone/sd-model", [], "'embedded' is no prompt file here"),
                                   (str(folder), [], "'embedded' is no prompt file here"),
                                   ("someone/sd-model", ["--prompt_set", "animal"], "(did you mean 'animals'?)")):
        module, cfg = script_config(script, ["--model_name_or_path", model, *extra, "--reward", "jpeg_compressibility",
                                             "--reward_weights", "1", "--output_dir", str(tmp_path / "out")])
        with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
            module.main(cfg)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1, err
        assert expected in err[0] and f"a hub or local model ({model!r}) needs --prompt_set" in err[0], err[0]
        assert ".txt" in err[0] and ".jsonl" in err[0] and "'animals'" in err[0]
