"""Two-step smoke runs of every entry point, in-process (the scripts are thin: parse config, call library)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run(name: str, argv: list[str]) -> dict:
    from unialign.config import parse_config

    module = load_script(name)
    cfg_cls = next(v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
                   and v.__module__ == module.__name__)
    return module.main(parse_config(cfg_cls, argv, presets=module.PRESETS))


def check_summary(out: Path, metric: str) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == metric
    assert all(math.isfinite(summary[k]) for k in ("before", "after", "wall_seconds"))
    return summary


@pytest.mark.slow
def test_grpo_math_two_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run("grpo_math", ["--max_steps", "2", "--num_eval", "16", "--prompts_per_step", "2", "--num_generations", "4",
                      "--eval_steps", "1", "--output_dir", str(tmp_path)])
    s = check_summary(tmp_path, "accuracy")
    assert s["steps"] == 2 and (tmp_path / "reward_curve.png").exists() and (tmp_path / "final" / "config.json").exists()
    assert s["model_defaults"]["model"] == "embedded" and s["model_defaults"]["values"]["learning_rate"] == 3e-4
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent), size_guidance={"scalars": 0})
    events.Reload()
    accuracy = events.Scalars("eval/accuracy")  # held-out greedy accuracy: before, every eval_steps, after
    assert [e.step for e in accuracy] == [0, 1, 2]
    assert accuracy[0].value == pytest.approx(s["before"]) and accuracy[-1].value == pytest.approx(s["after"])


@pytest.mark.slow
def test_grpo_math_dapo_and_resume(tmp_path):
    # a constant schedule: extending max_steps then changes nothing the checkpoint recorded (under the
    # default cosine it changes the schedule, and the resume is refused without --allow_config_change)
    common = ["--algorithm", "dapo", "--num_eval", "8", "--prompts_per_step", "2", "--num_generations", "4",
              "--output_dir", str(tmp_path), "--report_to", "none", "--save_steps", "1", "--lr_scheduler_type", "constant"]
    run("grpo_math", common + ["--max_steps", "1"])
    run("grpo_math", common + ["--max_steps", "2", "--resume_from_checkpoint", "latest"])
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2


def test_grpo_math_preset_fails_fast_offline(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    module = load_script("grpo_math")
    from unialign.config import exit_on_user_error, parse_config

    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        module.main(parse_config(module.GRPOMathConfig, ["--preset", "qwen2.5-0.5b-gsm8k"], presets=module.PRESETS))
    assert exit_info.value.code == 2 and "openai/gsm8k" in capsys.readouterr().err


@pytest.mark.parametrize("preset,names", [("sd3.5-medium-geneval", "owlv2-base-patch16"),  # GenEval's detector
                                          ("flux.1-dev-pickscore", "PickScore_v1"),
                                          ("sd3.5-medium-geneval-awm", "owlv2-base-patch16"),
                                          ("sd3.5-medium-geneval-nft", "owlv2-base-patch16"),
                                          ("sd3.5-medium-geneval-dgpo", "owlv2-base-patch16"),
                                          ("sd3.5-medium-geneval-grpo_guard", "owlv2-base-patch16"),
                                          ("sd3.5-medium-geneval-flow_dppo", "owlv2-base-patch16"),
                                          pytest.param("sd3.5-medium-ocr", "stable-diffusion-3.5-medium",
                                                       marks=pytest.mark.skipif(
                                                           importlib.util.find_spec("rapidocr_onnxruntime") is None,
                                                           reason="the ocr extra is not installed"))])
def test_flow_matching_presets_fail_fast_offline(monkeypatch, capsys, preset, names):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    module = load_script("grpo_image")
    from unialign.config import exit_on_user_error, parse_config

    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        module.main(parse_config(module.GRPOImageConfig, ["--preset", preset], presets=module.PRESETS))
    assert exit_info.value.code == 2 and names in capsys.readouterr().err
    assert time.perf_counter() - start < 30  # seconds, not a minute of retries


@pytest.mark.parametrize("argv,beta", [(["--algorithm", "awm"], 0.03),  # the embedded world's measured AWM KL
                                       (["--algorithm", "awm", "--beta", "0.001"], 0.001),
                                       (["--preset", "sd3.5-medium-geneval-awm"], 0.001),  # the paper's
                                       (["--preset", "sd3.5-medium-geneval-nft"], 1e-4),
                                       (["--algorithm", "nft"], 0.03),  # and nft_beta 0.1 (below)
                                       (["--algorithm", "nft", "--beta", "1e-4"], 1e-4),
                                       (["--preset", "sd3.5-medium-geneval-dgpo"], 0.02),  # DGPO's published KL
                                       (["--preset", "sd3.5-medium-geneval-grpo_guard"], 0.0)])
def test_forward_process_kl_resolves_to_the_measured_or_published_value(argv, beta):
    module = load_script("grpo_image")
    from unialign.config import parse_config

    cfg = parse_config(module.GRPOImageConfig, argv, presets=module.PRESETS)
    assert cfg.algo_spec().beta == pytest.approx(beta)


def test_model_family_from_folder_and_name(tmp_path):
    from unialign.recipes.image import ImageRLConfig, model_family, policy_kwargs, window_range

    def family(name, **kw):
        return model_family(ImageRLConfig(model_name_or_path=name, **kw))

    assert family("stabilityai/stable-diffusion-3.5-medium") == "sd3"
    assert family("black-forest-labs/FLUX.1-dev") == "flux"
    assert family("stabilityai/stable-diffusion-xl-base-1.0") == "sdxl"
    assert family("runwayml/stable-diffusion-v1-5") == "sd"
    assert family("runwayml/stable-diffusion-v1-5", model_family="flux") == "flux"
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    assert family(str(tmp_path)) == "sd3"
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(ValueError, match="model_name_or_path"):
        family(str(tmp_path))
    cfg = ImageRLConfig(sde_window_size=2, sde_window_range="1,5", num_steps=8)
    assert window_range(cfg) == (1, 5)
    flow, ddim = policy_kwargs(cfg, "sd3")["knobs"], policy_kwargs(cfg, "sd")["knobs"]
    assert flow.sde_window_size == 2 and flow.sde_window_range == (1, 5) and flow.eta is None
    assert flow.max_sequence_length is None  # the policy's own unless set
    assert ddim.noise_level is None and ddim.eta == 1.0
    with pytest.raises(ValueError, match="sde_window_range"):
        window_range(ImageRLConfig(sde_window_range="1-5"))


@pytest.mark.parametrize("kw, field", [
    (dict(model_name_or_path="embedded-sd3", sde_window_size=9, sde_window_range="0,6", num_steps=8), "sde_window_size"),
    (dict(model_name_or_path="embedded-sd3", sde_window_size=2, sde_window_range="5,2"), "sde_window_size"),
    (dict(model_name_or_path="embedded-sd3", sde_type="cps", noise_level=2.0), "noise_level"),
    (dict(model_name_or_path="embedded-sd3", model_family="flux"), "model_family"),
    (dict(model_name_or_path="embedded", model_family="sd3"), "model_family"),
    (dict(model_name_or_path="embedded", eta=0.0), "eta"),
    (dict(model_name_or_path="stabilityai/stable-diffusion-3.5-medium", sde_window_size=3, num_steps=2),
     "sde_window_size"),
    (dict(model_name_or_path="runwayml/stable-diffusion-v1-5", eta=-1.0), "eta"),
])
def test_image_sampling_knobs_are_refused_before_any_model_loads(monkeypatch, kw, field):
    """A window that does not fit the steps, an eta outside its step type's range, or a --model_family that
    contradicts the embedded model: one ValueError naming the field, and no model or reward is loaded."""
    from unialign.embedded import parts
    from unialign.embedded import shapes_world as world
    from unialign.recipes import image as recipe

    def loaded(*args, **kwargs):
        raise AssertionError("a model loaded before the bad input was named")

    for module, name in ((world, "load_embedded"), (world, "load_embedded_sd3"), (recipe, "load_policy"),
                         (recipe, "get_reward"), (parts, "get_reward")):
        monkeypatch.setattr(module, name, loaded)
    cfg = recipe.ImageRLConfig(reward_funcs="shape_verifier", **kw)
    build = parts.image_rl_parts if cfg.model_name_or_path in parts.IMAGE_MODELS else recipe.hub_parts
    with pytest.raises(ValueError, match=field):
        build(cfg)


@pytest.mark.slow
def test_dpo_text_two_steps(tmp_path):
    run("dpo_text", ["--max_steps", "2", "--num_eval", "16", "--batch_size", "8", "--micro_batch_size", "4",
                     "--output_dir", str(tmp_path), "--report_to", "none"])
    s = check_summary(tmp_path, "accuracy")
    # default RPO: the DPO part is ln 2 at init, plus rpo_alpha (1.0) x the chosen side's per-token NLL
    assert abs(s["first_loss"] - s["first_nll_loss"] - math.log(2)) < 1e-4 and s["first_nll_loss"] > 0
    assert "implicit_accuracy_after" in s


@pytest.mark.slow
def test_reward_model_then_ppo_two_steps(tmp_path):
    run("train_reward_model", ["--max_steps", "2", "--num_eval", "16", "--batch_size", "8",
                               "--output_dir", str(tmp_path / "rm"), "--report_to", "none"])
    check_summary(tmp_path / "rm", "pairwise_accuracy")
    run("ppo_rlhf", ["--max_steps", "2", "--num_eval", "16", "--prompts_per_step", "4", "--micro_batch_size", "4",
                     "--reward_model_path", str(tmp_path / "rm" / "final"), "--output_dir", str(tmp_path / "ppo"),
                     "--report_to", "none"])
    s = check_summary(tmp_path / "ppo", "accuracy")
    assert math.isfinite(s["rm_before"]) and math.isfinite(s["rm_after"])


IMAGE_SMOKE = ["--max_steps", "2", "--num_eval", "4", "--prompts_per_step", "2", "--num_generations", "4",
               "--micro_batch_size", "8", "--eval_steps", "1"]


@pytest.mark.slow
def test_ddpo_aesthetic_two_steps_with_kl(tmp_path):
    run("ddpo_aesthetic", IMAGE_SMOKE + ["--beta", "0.04", "--output_dir", str(tmp_path), "--report_to", "none"])
    s = check_summary(tmp_path, "reward")
    assert {"before_std", "gold_before", "gold_after", "fidelity_before", "fidelity_after", "aesthetic_before",
            "aesthetic_after", "shape_verifier_partial_before", "shape_verifier_partial_after"} <= set(s)
    assert 0.0 <= s["fidelity_before"] <= 1.0 and s["config"]["beta"] == 0.04
    assert all((tmp_path / f).exists() for f in ("comparison.png", "reward_curve.png"))


@pytest.mark.slow
@pytest.mark.parametrize("script,eval_prompt_set", [("grpo_image", None), ("ddpo_aesthetic", "train")])
def test_image_scripts_hold_out_a_users_prompts_or_say_they_do_not(tmp_path, monkeypatch, script, eval_prompt_set):
    """A user's --prompt_set is split (a seeded share held out, never trained on); asked to evaluate on the
    training prompts, the run says so in summary.json, the log and comparison.png's title."""
    from unialign.embedded import shapes_world
    from unialign.image.evaluate import HeldOutImages

    prompts = tmp_path / "mine.txt"
    prompts.write_text("\n".join(shapes_world.prompts("train")[:10]) + "\n")
    titles, stock = [], HeldOutImages.save_comparison
    monkeypatch.setattr(HeldOutImages, "save_comparison",
                        lambda self, path, b, a, title="": titles.append(title) or stock(self, path, b, a, title))
    import unialign.recipes.image as recipe

    seen: dict[str, list[str]] = {}

    class Recording(recipe.OnlineTrainer):
        def __init__(self, policy, reward, rows, cfg, evaluator=None):
            seen.update(train=[r["prompt"] for r in rows], eval=list(evaluator.prompts))
            super().__init__(policy, reward, rows, cfg, evaluator=evaluator)

    monkeypatch.setattr(recipe, "OnlineTrainer", Recording)
    extra = [] if eval_prompt_set is None else ["--eval_prompt_set", eval_prompt_set]
    out = tmp_path / "run"
    run(script, IMAGE_SMOKE + ["--prompt_set", str(prompts), *extra, "--output_dir", str(out), "--report_to", "none"])
    s = check_summary(out, "reward")
    if eval_prompt_set is None:
        assert s["eval_source"].startswith("held out: 1 of the 10 prompts") and "held-out reward" in titles[0]
        assert len(set(seen["train"])) == 9 and not set(seen["train"]) & set(seen["eval"])
    else:
        assert s["eval_source"].startswith("training prompts") and "held-out" not in titles[0]
        assert "train-prompt reward" in titles[0] and set(seen["eval"]) <= set(seen["train"])


@pytest.mark.slow
@pytest.mark.parametrize("script,extra", [("ddpo_aesthetic", []), ("grpo_image", ["--sampler", "dpmpp"])])
def test_forward_process_rl_on_the_embedded_unet(tmp_path, script, extra):
    """``--algorithm awm`` on the SD1-family UNet of ddpo_aesthetic (the aesthetic reward) and on grpo_image's
    embedded SDXL model (DPM-Solver++ collection): the forward-process trajectory (K pairs, not sampler steps)
    trains the UNet through the unchanged trainer and reports reward, fidelity, gold and grids."""
    run(script, IMAGE_SMOKE + ["--algorithm", "awm", "--train_timesteps", "2", *extra, "--output_dir", str(tmp_path),
                               "--report_to", "none"])
    s = check_summary(tmp_path, "reward")
    assert s["algorithm_spec"]["log_prob_estimator"] == "forward" and s["config"]["algorithm"] == "awm"
    assert {"gold_before", "gold_after", "fidelity_before", "fidelity_after"} <= set(s)
    assert all((tmp_path / f).exists() for f in ("comparison.png", "final"))


@pytest.mark.slow
def test_grpo_image_two_steps_lora_kl_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run("grpo_image", IMAGE_SMOKE + ["--beta", "0.04", "--lora_rank", "4", "--output_dir", str(tmp_path)])
    s = check_summary(tmp_path, "reward")
    assert s["reward"] == "shape_verifier_partial" and {"fidelity_before", "fidelity_after"} <= set(s)
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").exists()
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent),
                              size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    scalars, images = set(events.Tags()["scalars"]), set(events.Tags()["images"])
    assert {"eval/fidelity", "eval/reward", "kl", "reward/shape_verifier_partial/fidelity"} <= scalars
    assert "eval/grid" in images
    assert [e.step for e in events.Scalars("eval/fidelity")] == [0, 1, 2]  # before, every eval_steps, after


@pytest.mark.parametrize("algorithm,extra", [("flow_grpo", ["--sde_window_size", "2", "--sde_window_range", "0,6"]),
                                             ("awm", []), ("nft", [])])
@pytest.mark.slow
def test_grpo_image_embedded_sd3_lora_loads_in_the_stock_pipeline(tmp_path, algorithm, extra):
    """The flow-matching route end to end: ``--model_name_or_path embedded-sd3`` with Flow-GRPO's preset and an SDE
    window, or forward-process RL (AWM, DiffusionNFT with its old policy), with LoRA; the saved LoRA loads with
    stock ``StableDiffusion3Pipeline`` + ``load_lora_weights`` and changes its transformer's output."""
    from diffusers import StableDiffusion3Pipeline

    from unialign.embedded import shapes_world

    run("grpo_image", IMAGE_SMOKE + ["--model_name_or_path", "embedded-sd3", "--algorithm", algorithm, "--lora_rank",
                                     "4", *extra, "--learning_rate", "1e-2", "--output_dir", str(tmp_path),
                                     "--report_to", "none"])
    s = check_summary(tmp_path, "reward")
    assert s["config"]["algorithm"] == algorithm
    assert {"fidelity_before", "fidelity_after"} <= set(s)
    pipe = StableDiffusion3Pipeline.from_pretrained(str(shapes_world.sd3_dir()), text_encoder_3=None, tokenizer_3=None)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    embeds, _, pooled, _ = pipe.encode_prompt("a red circle on a blue background", None, None, do_classifier_free_guidance=False,
                                              max_sequence_length=shapes_world.SD3_MAX_SEQUENCE_LENGTH)
    t = torch.tensor([700.0])
    with torch.no_grad():
        base = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled).sample
        pipe.load_lora_weights(str(tmp_path / "final"))
        tuned = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds,
                                 pooled_projections=pooled).sample
    assert (tuned - base).abs().max() > 1e-6  # the adapters were loaded and trained


@pytest.mark.slow
def test_grpo_image_awm_full_weights_load_in_the_stock_pipeline(tmp_path):
    """Forward-process RL without LoRA: ``final/transformer`` is a diffusers ``SD3Transformer2DModel`` folder that
    the stock ``StableDiffusion3Pipeline`` takes as its transformer and samples with (changed weights, finite
    images)."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from unialign.embedded import shapes_world

    run("grpo_image", IMAGE_SMOKE + ["--model_name_or_path", "embedded-sd3", "--algorithm", "awm", "--learning_rate",
                                     "1e-2", "--output_dir", str(tmp_path), "--report_to", "none"])
    tuned = SD3Transformer2DModel.from_pretrained(str(tmp_path / "final" / "transformer"))
    pipe = StableDiffusion3Pipeline.from_pretrained(str(shapes_world.sd3_dir()), text_encoder_3=None, tokenizer_3=None)
    base = dict(pipe.transformer.named_parameters())
    assert any((p - base[n]).abs().max() > 1e-6 for n, p in tuned.named_parameters())
    pipe = StableDiffusion3Pipeline.from_pretrained(str(shapes_world.sd3_dir()), transformer=tuned,
                                                    text_encoder_3=None, tokenizer_3=None)
    out = pipe(["a red circle on a blue background"], num_inference_steps=4, guidance_scale=1.0, height=32, width=32,
               max_sequence_length=shapes_world.SD3_MAX_SEQUENCE_LENGTH, output_type="np").images
    assert out.shape == (1, 32, 32, 3) and np.isfinite(out).all()


@pytest.mark.slow
def test_dpo_sdxl_on_the_flow_matching_embedded_model(tmp_path):
    """Diffusion-DPO through the script on embedded-sd3: the velocity-MSE surrogate, ln 2 at init, fidelity kept."""
    run("dpo_sdxl", ["--model_name_or_path", "embedded-sd3", "--max_steps", "2", "--num_prompts", "4",
                     "--num_eval_images", "8", "--eval_timestep_samples", "1", "--output_dir", str(tmp_path),
                     "--report_to", "none"])
    s = check_summary(tmp_path, "gold_score")
    assert abs(s["first_loss"] - math.log(2)) < 1e-4 and s["implicit_accuracy_before"] == 0.5
    assert 0.0 <= s["fidelity_after"] <= 1.0


def test_a_replacement_vae_is_refused_for_flow_matching_before_loading(tmp_path):
    from unialign.recipes.image import load_denoiser

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    with pytest.raises(ValueError, match="vae_name_or_path"):
        load_denoiser(str(tmp_path), vae_name_or_path="madebyollin/sdxl-vae-fp16-fix")


def test_image_scripts_reject_bad_input_before_loading(tmp_path, capsys):
    from unialign.config import exit_on_user_error, parse_config

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle on a blue background\na cat\n")
    module = load_script("grpo_image")
    for argv, message in ((["--prompt_set", str(prompts)], "prompt_set[1]: shape_verifier: cannot parse prompt 'a cat'"),
                          (["--reward", "aesthetic,shape_verifier", "--reward_weights", "1"], "reward_weights: 1 weights")):
        with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
            module.main(parse_config(module.GRPOImageConfig, argv + ["--output_dir", str(tmp_path)]))
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_dpo_sdxl_two_steps(tmp_path):
    run("dpo_sdxl", ["--max_steps", "2", "--num_prompts", "4", "--pairs_per_prompt", "2", "--eval_pairs_per_prompt", "2",
                     "--min_gap", "0", "--batch_size", "4", "--micro_batch_size", "4", "--eval_timestep_samples", "2",
                     "--num_eval_images", "8", "--gradient_checkpointing", "true", "--optim", "adafactor",
                     "--output_dir", str(tmp_path), "--report_to", "none"])
    s = check_summary(tmp_path, "gold_score")
    assert 0.0 <= s["fidelity_before"] <= 1.0 and 0.0 <= s["fidelity_after"] <= 1.0
    assert abs(s["first_loss"] - math.log(2)) < 1e-4
    # before training the policy is its reference: every margin is 0, a tie counted 1/2, however many draws
    assert s["implicit_accuracy_before"] == s["implicit_accuracy_before_k1"] == 0.5
    assert 0.0 <= s["implicit_accuracy_after"] <= 1.0


# ---------------------------------------------------------------- a user's own data, reward and mistakes
def run_cli(name: str, argv: list[str], capsys) -> tuple[int, str]:
    """What ``python scripts/<name>.py ARGV`` does in-process: (exit status, last stderr line)."""
    from unialign.config import exit_on_user_error, parse_config

    module = load_script(name)
    cfg_cls = next(v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
                   and v.__module__ == module.__name__)
    try:
        with exit_on_user_error():
            module.main(parse_config(cfg_cls, argv, presets=module.PRESETS))
    except SystemExit as exc:
        err = capsys.readouterr().err.strip().splitlines()
        return exc.code, err[-1] if err else ""
    return 0, ""


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


TRL_ROWS = [{"prompt": f"Ann has {a} pens and buys {b} more. How many now?", "solution": str(a + b)}
            for a, b in zip(range(11, 41), range(52, 82))]


@pytest.mark.slow
def test_bad_input_exits_2_with_one_line_before_any_model_loads(tmp_path, capsys, no_model, user_module):
    user_module("gold_rewards", "def needs_gold(completions, gold, **kwargs):\n    return [0.0] * len(gold)\n")
    good = write_jsonl(tmp_path / "good.jsonl", TRL_ROWS)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b",}\n')
    write_jsonl(tmp_path / "schema.jsonl", [{"text": "hello"}] * 5)
    no_reference = write_jsonl(tmp_path / "no_reference.jsonl", [{"prompt": r["prompt"]} for r in TRL_ROWS])
    (tmp_path / "wrong.yaml").write_text("max_steps: ten\n")
    (tmp_path / "a_file").write_text("x")
    out = ["--output_dir", str(tmp_path / "out")]
    cases = [
        (["--dataset_name", str(tmp_path / "empty.jsonl")], "empty.jsonl' has no rows"),
        (["--dataset_name", str(tmp_path / "bad.jsonl")], "bad.jsonl:2: not valid JSON"),
        (["--dataset_name", str(tmp_path / "schema.jsonl")], "schema.jsonl row 0: no 'prompt' column"),
        (["--dataset_name", str(good), "--reward_funcs", "gold_rewards:needs_gold"],
         "reward 'gold_rewards:needs_gold' needs the column(s) ['gold']"),
        (["--reward_funcs", "nosuch_reward"], "--reward_funcs: unknown reward 'nosuch_reward'"),
        (["--reward_funcs", "reward_model"], "--reward_funcs: reward 'reward_model' needs path"),
        (["--dataset_name", str(no_reference)],
         "reward 'math_accuracy' needs one of the columns ['answer', 'solution'] (the reference answer), which the "
         "dataset does not have"),
        (["--dataset_name", str(good), "--eval_split", "test"], "is a single file without splits"),
        (["--torch_dtype", "nosuch"], "--torch_dtype: 'nosuch' is not one of"),
        (["--config", str(tmp_path / "wrong.yaml")], "wrong.yaml: --max_steps: expected an integer, got 'ten'"),
        (["--prompts_per_step", "0"], "--prompts_per_step: must be >= 1, got 0"),
        (["--loss_type", "nosuch"], "--loss_type: 'nosuch' is not one of"),
        (["--temperature", "0"], "--temperature: must be > 0.0, got 0.0"),
        (["--max_steps", "0"], "--max_steps: must be >= 1, got 0"),
    ]
    for argv, message in cases:
        code, line = run_cli("grpo_math", argv + out, capsys)
        assert code == 2 and message in line, (argv, line)
    code, line = run_cli("grpo_math", ["--output_dir", str(tmp_path / "a_file")], capsys)
    assert code == 2 and "exists and is not a directory" in line
    code, line = run_cli("dpo_text", ["--dataset_name", str(tmp_path / "schema.jsonl")] + out, capsys)
    assert code == 2 and "schema.jsonl row 0: missing field 'chosen'" in line
    code, line = run_cli("grpo_image", ["--reward", "nosuch"] + out, capsys)
    assert code == 2 and "--reward_funcs: unknown reward 'nosuch'" in line  # --reward: an alias of --reward_funcs
    code, line = run_cli("dpo_sdxl", ["--dataset_name", str(tmp_path / "bad.jsonl")] + out, capsys)
    assert code == 2 and "bad.jsonl:2: not valid JSON" in line
    code, line = run_cli("dpo_sdxl", ["--model_name_or_path", "runwayml/stable-diffusion-v1-5"] + out, capsys)
    assert code == 2 and "--dataset_name embedded" in line  # before any download is tried
    code, line = run_cli("grpo_math", ["--generation_backend", "vllm"] + out, capsys)
    assert code == 2 and "--generation_backend vllm needs" in line


def test_huge_prompt_refused_naming_the_row_before_any_forward(tmp_path, capsys, monkeypatch):
    from unialign.text.policy import CausalLMPolicy

    def no_forward(*args, **kwargs):
        raise AssertionError("the model ran before the prompt was refused")

    monkeypatch.setattr(CausalLMPolicy, "generate", no_forward)
    monkeypatch.setattr(CausalLMPolicy, "sample", no_forward)
    rows = TRL_ROWS[:5] + [{"prompt": "x" * 1_000_000, "solution": "1"}] + TRL_ROWS[5:]
    data = write_jsonl(tmp_path / "big.jsonl", rows)
    argv = ["--dataset_name", str(data), "--reward_funcs", "math_format", "--eval_fraction", "0.1",
            "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    code, line = run_cli("grpo_math", argv, capsys)
    assert code == 2 and "big.jsonl: 1 of 28 rows are too long (row 5: prompt has at least " in line, line  # its row in the file
    assert "tokens > 512" in line  # a lower bound, counted without tokenizing a million characters
    assert "--max_prompt_length" in line
    pairs = [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}] * 9 + [{"prompt": "2+2?", "chosen": "4" * 5000,
                                                                          "rejected": "5"}]
    code, line = run_cli("dpo_text", ["--dataset_name", str(write_jsonl(tmp_path / "pairs.jsonl", pairs)),
                                      "--max_completion_length", "64", "--eval_fraction", "0.1",
                                      "--output_dir", str(tmp_path / "out2")], capsys)
    assert code == 2 and "pairs.jsonl: " in line and "row 9: chosen has 5001 tokens > 64" in line, line
    assert "--max_completion_length" in line
    pairs[3] = {"prompt": "1+1?" * 300, "chosen": "2", "rejected": "3"}
    code, line = run_cli("train_reward_model", ["--dataset_name", str(write_jsonl(tmp_path / "pairs.jsonl", pairs)),
                                                "--max_prompt_length", "1000", "--eval_fraction", "0.1",
                                                "--output_dir", str(tmp_path / "out3")], capsys)
    assert code == 2 and "pairs.jsonl: " in line and "row 3: prompt has" in line, line


@pytest.mark.slow
def test_grpo_on_a_folder_of_trl_rows_with_a_custom_reward(tmp_path, user_module):
    user_module("my_rewards", "def exact(completions, solution, **kwargs):\n"
                              "    return [float(s in c) for c, s in zip(completions, solution)]\n")
    data = tmp_path / "data"
    data.mkdir()
    chat = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in TRL_ROWS[:10]]
    write_jsonl(data / "train.jsonl", TRL_ROWS[10:] + chat)
    write_jsonl(data / "test.jsonl", TRL_ROWS[:6])
    s = run("grpo_math", ["--dataset_name", str(data), "--reward_funcs", "my_rewards:exact", "--max_steps", "2",
                          "--prompts_per_step", "2", "--num_generations", "4", "--output_dir", str(tmp_path / "out"),
                          "--report_to", "none"])
    # the held-out rows carry TRL's solution column: evaluated with math_accuracy, not the training reward
    assert s["metric"] == "accuracy" and s["steps"] == 2 and s["eval_source"].endswith("[test]")
    assert (s["train_rows"], s["eval_rows"]) == (30, 6) and s["config"].get("dataset_config") is None


def test_single_file_holds_out_a_fraction_stated_in_the_summary(tmp_path):
    pairs = [{"prompt": f"{a}+{a}?", "chosen": f"#### {2 * a}", "rejected": f"#### {2 * a + 1}"} for a in range(40)]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    s = run("dpo_text", ["--dataset_name", str(data), "--eval_fraction", "0.25", "--max_steps", "1", "--batch_size", "4",
                         "--micro_batch_size", "4", "--output_dir", str(tmp_path / "out"), "--report_to", "none"])
    assert (s["train_rows"], s["eval_rows"], s["eval_fraction"]) == (30, 10, 0.25) and s["metric"] == "implicit_accuracy"
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved["eval_fraction"] == 0.25 and "held out" in saved["eval_source"]


# ---------------------------------------------------------------- the README's Python API, as written there
def test_python_api_grpo_in_ten_lines(tmp_path):
    import datasets

    from unialign import OnlineConfig, OnlineTrainer, get_reward
    from unialign.embedded import load_arith_policy  # the shipped arithmetic model (offline)

    def brevity(completions, **kwargs):  # any TRL-style reward: f(prompts, completions, **columns)
        return [-len(c) / 100 for c in completions]

    rows = datasets.Dataset.from_list([{"prompt": f"Ann has {a} pens and buys 30 more. How many now?",
                                        "answer": str(a + 30)} for a in range(10, 18)])
    policy = load_arith_policy()
    config = OnlineConfig(max_steps=2, prompts_per_step=4, num_generations=4, output_dir=str(tmp_path), report_to="none")
    history = OnlineTrainer(policy, [get_reward("math_accuracy"), brevity], rows, config).train()
    assert len(history) == 2 and all(math.isfinite(h["reward/brevity"]) for h in history)


def test_python_api_dpo_in_ten_lines(tmp_path):
    from unialign import DPOObjective, PreferenceConfig, PreferenceTrainer
    from unialign.embedded import load_arith_policy

    pairs = [{"prompt": "Tom has 15 cards and gets 27 more. How many now?",
              "chosen": "5+7=12,1+2+1=4\n#### 42", "rejected": "5+7=12,1+2=3\n#### 32"}] * 8
    policy = load_arith_policy()
    config = PreferenceConfig(max_steps=2, batch_size=4, micro_batch_size=4, output_dir=str(tmp_path), report_to="none")
    history = PreferenceTrainer(DPOObjective(policy, beta=0.1), pairs, config).train()
    assert len(history) == 2 and abs(history[0]["loss"] - math.log(2)) < 1e-4


@pytest.mark.slow
def test_dpo_sdxl_on_a_folder_with_image_paths(tmp_path):
    from PIL import Image

    data = tmp_path / "pairs"
    (data / "img").mkdir(parents=True)
    for i, colour in enumerate([(200, 30, 30), (30, 30, 200), (30, 200, 30), (200, 200, 30)]):
        Image.new("RGB", (32, 32), colour).save(data / "img" / f"{i}.png")
    rows = [{"caption": "a red circle on a blue background", "jpg_0": f"img/{i % 4}.png",
             "jpg_1": f"img/{(i + 1) % 4}.png", "label_0": i % 2} for i in range(10)]
    write_jsonl(data / "train.jsonl", rows)
    s = run("dpo_sdxl", ["--dataset_name", str(data), "--max_steps", "1", "--batch_size", "4", "--micro_batch_size", "4",
                         "--eval_timestep_samples", "1", "--num_eval_images", "4", "--output_dir", str(tmp_path / "out"),
                         "--report_to", "none"])
    # rows i, i+4, i+8 are the same pair: the held-out pair's copies leave training too
    dropped = s.get("train_duplicates_of_held_out_dropped", 0)
    assert s["metric"] == "implicit_accuracy" and s["num_eval_pairs"] == 1 and dropped >= 1  # the user's pairs
    assert s["train_pairs"] == 9 - dropped and s["eval_fraction"] == 0.1 and s["steps"] == 1


@pytest.mark.slow
def test_skipped_reward_errors_are_counted_in_the_summary(tmp_path, user_module):
    user_module("flaky_rewards", "def flaky(prompts, completions, **kwargs):\n"
                                 "    return [1.0 if i % 2 else 'oops' for i in range(len(completions))]\n")
    s = run("grpo_math", ["--reward_funcs", "flaky_rewards:flaky", "--reward_errors", "skip", "--max_steps", "1",
                          "--num_eval", "4", "--prompts_per_step", "2", "--num_generations", "4",
                          "--output_dir", str(tmp_path / "out"), "--report_to", "none"])
    assert s["reward_errors"] == 4  # half of the 8 samples of the one step


@pytest.mark.slow
def test_a_scripts_own_defaults_for_another_algorithm_apply_under_what_is_set(tmp_path):
    """grpo_image's measured KL for AWM on its world (ALGORITHM_DEFAULTS) fills only an unset --beta; other knobs
    take AWM's published values, and the script's default algorithm keeps the script's own."""
    from unialign.config import parse_config

    module = load_script("grpo_image")

    def spec(*argv):
        return parse_config(module.GRPOImageConfig, [*argv, "--output_dir", str(tmp_path)],
                            presets=module.PRESETS).algo_spec()

    assert spec("--algorithm", "awm").beta == 0.03 and spec("--algorithm", "awm").advantage_scale == 0.2
    assert spec("--algorithm", "awm", "--beta", "0.001").beta == 0.001
    assert spec("--algorithm", "nft").beta == 0.03 and spec("--algorithm", "nft").nft_beta == 0.1
    assert spec("--preset", "sd3.5-medium-geneval-nft").nft_beta == 1.0 and spec().beta == 0.1
    # DGPO on the embedded world: six pairs over 0.9 of the schedule, no clip; its SD3.5-M preset keeps the paper's
    cfg = parse_config(module.GRPOImageConfig, ["--algorithm", "dgpo", "--output_dir", str(tmp_path)],
                       presets=module.PRESETS)
    assert (cfg.train_timesteps, cfg.forward_fraction, cfg.algo_spec().epsilon, cfg.old_policy_decay) == (
        6, 0.9, 1.0, "off")  # no clip, so no old policy to keep
    cfg = parse_config(module.GRPOImageConfig, ["--preset", "sd3.5-medium-geneval-dgpo", "--output_dir",
                                                 str(tmp_path)], presets=module.PRESETS)
    assert (cfg.train_timesteps, cfg.forward_fraction, cfg.algo_spec().epsilon, cfg.old_policy_decay) == (
        4, 0.5, 1e-3, "awm")
    # the paper's clip on the embedded world needs the old policy it compares with, named before any model loads
    from unialign.recipes.image import forward_process_kwargs

    cfg = parse_config(module.GRPOImageConfig, ["--algorithm", "dgpo", "--epsilon", "1e-3", "--output_dir",
                                                 str(tmp_path)], presets=module.PRESETS)
    with pytest.raises(ValueError, match="^old_policy_decay=off: dgpo's clip"):
        forward_process_kwargs(cfg)
    cfg.old_policy_decay = "awm"
    assert forward_process_kwargs(cfg)["old_decay"](100) == pytest.approx(0.1)
