"""RL on text-to-video (Wan 2.1): forward-process RL or the GRPO family, any video reward or image reward per frame.

    accelerate launch scripts/grpo_video.py                                   # offline embedded default (AWM), CPU
    accelerate launch scripts/grpo_video.py --algorithm flow_grpo             # Flow-GRPO: SDE steps, per-step log-probs
    accelerate launch scripts/grpo_video.py --reward_funcs motion_verifier_partial,temporal_consistency \
        --reward_weights 1,0.2
    accelerate launch scripts/grpo_video.py --preset wan2.1-t2v-1.3b-pickscore --prompt_set my_prompts.txt

The same ``OnlineTrainer`` as ``scripts/grpo_image.py`` trains a Wan policy (``FlowPolicyBase`` with
``WanFamily``: 5-D latents [B, C, F, H, W]) by forward-process RL (AWM, the default: clips sampled by the
deterministic solver, trained by advantage-weighted flow matching at fresh noise) or by the GRPO family on
Flow-GRPO's SDE steps; a completion is a clip, a list of frames.
The default reward is the *verifiable* ``motion_verifier_partial`` (what the prompt asks for -- background,
colour, shape and the direction it moves -- read from the frames, ``unialign/embedded/motion_world.py``); an image
reward (``pickscore``, ``aesthetic``, ...) scores every frame and a clip the mean or min of them
(``--frame_reduction``). Writes ``<output_dir>/summary.json`` (held-out reward and prompt fidelity before / after
on fixed seeds), ``comparison.png`` (each held-out prompt's clip before over after, frames left to right),
``reward_curve.png``, TensorBoard logs, checkpoints and ``final/`` (a stock ``WanPipeline`` folder; with
``--lora_rank`` the LoRA for its ``load_lora_weights``).

Embedded default (no arguments): see docs/video.md for the measured numbers; the choices are in the
``GRPOVideoConfig`` comments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from unialign.config import arg, default, exit_on_user_error, parse_config
from unialign.embedded import parts, register
from unialign.recipes import presets
from unialign.recipes.image import ImageRLDefaults

PRESETS = {k: v for k, v in presets.GRPO_IMAGE.items() if v.get("model_family") == "wan"}


@dataclass
class GRPOVideoConfig(ImageRLDefaults):
    PRESETS: ClassVar[dict] = PRESETS
    model_name_or_path: str = arg("embedded-wan", "Wan 2.1 hub id or local WanPipeline folder, or 'embedded-wan' "
                                  "(the shipped tiny Wan-architecture model of the motion world)")
    prompt_set: str = arg("embedded", "'embedded' (the motion world's train / held-out prompts), 'animals', a .txt "
                          "file (one per line) or a .jsonl file (a 'prompt' and other columns per line)")
    reward_funcs: str = arg("motion_verifier_partial", "comma-separated registry names: video rewards "
                            "(motion_verifier[_partial], temporal_consistency, per_frame) or image rewards scored "
                            "per frame (pickscore, aesthetic, clip_score, ...)")
    # the embedded default: measured on held-out fidelity (docs/video.md): AWM with a KL of 0.03 +0.30-0.32 in
    # 307-320 s (without it +0.33-0.36 and less clean clips); Flow-GRPO +0.15-0.20 in 195-202 s, its knobs below
    algorithm: str = arg("awm", "awm | nft | dgpo | flow_grpo | grpo | grpo_guard | flow_dppo | dapo | dr_grpo | "
                         "gspo | rloo | reinforce")
    # the SDE window: the GRPO family's (--algorithm flow_grpo ...), measured for it
    sde_window_size: int = arg(3, "only a window of this many consecutive steps per sampling call is stochastic and "
                               "trained, the rest deterministic Euler steps (Flow-GRPO-Fast); 0: every step")
    sde_window_range: str | None = arg("0,6", "'lo,hi' -- the window starts uniformly in [lo, hi - size] (unset: "
                                       "0,num_steps)")
    beta: float | None = arg(0.03, "KL coefficient (0: no reference model)")
    epsilon: float | None = default(None)  # AWM's trust region, not the image scripts' GRPO clip
    kl_estimator: str | None = default(None)  # AWM's: the prediction MSE to the reference
    num_generations: int = arg(8, "clips per prompt (G, the group)")
    prompts_per_step: int = default(8)  # 64 clips a step
    num_eval: int = default(192)  # 96 clips read the fidelity to +-0.05 (one standard error): too coarse for +0.25
    max_steps: int = default(100)
    eval_steps: int = default(25)
    output_dir: str = default("outputs/grpo_video")
    # Flow-GRPO here: the image scripts' clip, no KL (--beta 0.04, its published value: +0.14 against +0.20)
    ALGORITHM_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "flow_grpo": {"beta": 0.0, "epsilon": 1e-2, "kl_estimator": "gaussian"}}


def main(cfg: GRPOVideoConfig) -> dict:
    register()  # the demo worlds by name: the motion world's prompts and verifiers
    return parts.run_online_image(cfg)  # the embedded model's world, else the hub route


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(GRPOVideoConfig))
