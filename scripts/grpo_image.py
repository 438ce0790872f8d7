"""The GRPO family on images, with any image reward: Flow-GRPO's GenEval experiment in miniature.

    accelerate launch scripts/grpo_image.py                                  # offline embedded default, CPU
    accelerate launch scripts/grpo_image.py --model_name_or_path embedded-sd3 # its flow-matching (SD3) twin
    accelerate launch scripts/grpo_image.py --beta 0.04 --lora_rank 4         # KL to the reference, LoRA
    accelerate launch scripts/grpo_image.py --reward_funcs aesthetic,shape_verifier --reward_weights 1,1
    accelerate launch scripts/grpo_image.py --preset sd15-clip --prompt_set my_prompts.txt
    accelerate launch scripts/grpo_image.py --model_name_or_path embedded-sd3 --reward_funcs geneval  # GenEval's rules
    accelerate launch scripts/grpo_image.py --preset sd3.5-medium-geneval --prompt_set train_metadata.jsonl
    accelerate launch scripts/grpo_image.py --preset sd3.5-medium-ocr --prompt_set ocr_train.txt  # .[ocr] extra

The same ``OnlineTrainer`` as ``scripts/grpo_math.py`` trains a ``DiffusionPolicy`` (SD1.x / SDXL, DDIM) or a
flow-matching policy (SD3 / FLUX.1, Flow-GRPO's SDE step; ``--algorithm flow_grpo``) whose steps are
denoising transitions, with group-normalised advantages (``--algorithm grpo | dapo | dr_grpo | gspo |
rloo | reinforce``). The default reward is the *verifiable* ``shape_verifier`` (what the prompt asks
for -- background colour, object colour, shape -- read from the pixels, ``unialign/embedded/shape_verifier.py``),
the image counterpart of the math verifier. Writes ``<output_dir>/summary.json`` (held-out reward and
prompt fidelity before/after on fixed seeds), ``comparison.png`` (held-out prompts before | after),
``reward_curve.png`` (held-out fidelity every ``--eval_steps``), TensorBoard logs, checkpoints, ``final/`` (a
whole diffusers pipeline folder: ``DiffusionPipeline.from_pretrained``; with ``--lora_rank`` the LoRA).

Embedded default (no arguments): see the README's status table for the measured numbers; the choices
and what each did are in the ``GRPOImageConfig`` comments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from unialign.config import arg, default, exit_on_user_error, parse_config
from unialign.embedded import parts, register
from unialign.recipes import presets
from unialign.recipes.image import ImageRLDefaults

PRESETS = presets.GRPO_IMAGE


@dataclass
class GRPOImageConfig(ImageRLDefaults):
    PRESETS: ClassVar[dict] = PRESETS
    # the embedded default: every choice below was measured on held-out fidelity (docs/images.md, "The embedded
    # defaults, measured"); another --algorithm takes its published knobs but for these (ALGORITHM_DEFAULTS)
    model_name_or_path: str = arg("embedded", "SD1.x / SDXL / SD3 / FLUX.1 hub id or local diffusers folder, or "
                                  "'embedded' (the shipped tiny SDXL-architecture model) / 'embedded-sd3' (its "
                                  "flow-matching twin)")
    prompt_set: str = arg("embedded", "'embedded' (the shapes world's train / held-out prompts), 'animals', a .txt "
                          "file (one per line) or a .jsonl file (a 'prompt' and other columns per line, e.g. GenEval's "
                          "metadata)")
    reward_funcs: str = arg("shape_verifier_partial", "comma-separated registry names (shape_verifier[_partial], "
                            "geneval, ocr, aesthetic, clip_score, pickscore, jpeg_compressibility, ...)")
    algorithm: str = arg("grpo", "grpo | flow_grpo | grpo_guard | flow_dppo | pref_grpo | awm | nft | dgpo | dapo | "
                         "dr_grpo | gspo | gspo_token | rloo | reinforce")
    sde_window_size: int = arg(3, "flow matching: only a window of this many consecutive steps per sampling call is "
                               "stochastic and trained, the rest deterministic Euler steps (Flow-GRPO-Fast / MixGRPO); "
                               "0: every step")
    sde_window_range: str | None = arg("0,6", "flow matching: 'lo,hi' -- the window starts uniformly in [lo, hi - "
                                       "size] (unset: 0,num_steps)")
    beta: float | None = arg(0.1, "KL coefficient (0: no reference model)")
    num_generations: int = arg(16, "images per prompt (G, the group)")
    max_steps: int = default(350)
    output_dir: str = default("outputs/grpo_image")
    # DGPO here: AWM's six pairs from 0.9 of the schedule (its published four from the noisiest half leave the
    # shapes' corners to the base model: reader 0.71 -> 0.81) and no clip (its 1e-3 on exp(err_old - err) holds
    # 13-14 % of this tiny model's errors early on and slows it 1.5-2.6x), so no old policy to clip against;
    # docs/forward_rl.md, "DGPO on this world"
    ALGORITHM_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "awm": {"beta": 0.03}, "nft": {"nft_beta": 0.1, "beta": 0.03},
        "dgpo": {"train_timesteps": 6, "forward_fraction": 0.9, "epsilon": 1.0, "old_policy_decay": "off"}}


def main(cfg: GRPOImageConfig) -> dict:
    register()  # the demo worlds by name: data set 'embedded', the shape verifiers, GenEval's 'shapes' backend
    return parts.run_online_image(cfg)  # an embedded model's world, else the hub route


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(GRPOImageConfig))
