"""The offline demo worlds the scripts run by default, kept out of the library's core (which never imports
this package): a tiny arithmetic task with its model (``arith``), and a world of captioned synthetic shapes
with a tiny SDXL-architecture model, CLIP and aesthetic head (``shapes_world``), its verifiable reward
(``shape_verifier``), its GenEval backend (``geneval_shapes``) and the parts the scripts assemble from them
(``parts``). The weights are in ``assets/``; the code that built them is not installed (``tools/`` of the source
checkout: ``python -m tools.build_arith_lm``, ``python -m tools.build_shapes_world``).

The scripts resolve the word ``"embedded"`` (``NAME``) here: ``--model_name_or_path embedded`` is
``model_path(...)``. Importing this package registers nothing; ``register()``, one explicit call the scripts
make, adds the worlds to the core registries by name: the arithmetic data set and its preference pairs
(``unialign.text.data.NAMED_DATASETS`` / ``NAMED_PAIR_DATASETS``), the shape verifiers
(``unialign.rewards.registry.REWARDS`` / ``REWARD_INPUTS``) and GenEval's ``"shapes"`` backend
(``unialign.rewards.geneval.GENEVAL_BACKENDS``)::

    import unialign.embedded
    unialign.embedded.register()                 # idempotent; a name already registered is left as it is
    from unialign.embedded import load_arith_policy
    policy = load_arith_policy()   # the shipped arithmetic model as a CausalLMPolicy
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NAME = "embedded"
ARITH_LM_DIR = Path(__file__).resolve().parent / "assets" / "arith_lm"  # = arith.DEFAULT_ASSET_DIR
VLM_NAME = "embedded-vlm"  # the vision-language task (vlm.py): data set, pair data set and model path by this name
VLM_DIR = Path(__file__).resolve().parent / "assets" / "vlm"  # = vlm.VLM_DIR
VLM_VIDEO_NAME = "embedded-vlm-video"  # the video question task (vlm_video.py): data sets and model by this name
VLM_VIDEO_DIR = Path(__file__).resolve().parent / "assets" / "vlm_video"  # = vlm_video.VLM_VIDEO_DIR
# A shipped data set that only its own shipped model reads (new words): the model a script takes for it when
# --model_name_or_path is left unset (a config's DATASET_MODELS, ``unialign.config``)
DATASET_MODELS = {VLM_VIDEO_NAME: VLM_VIDEO_NAME}
MDLM_NAME = "embedded-mdlm"  # the arithmetic task's masked-diffusion LM (mdlm.py): a model path by this name
MDLM_DIR = Path(__file__).resolve().parent / "assets" / "mdlm"  # = mdlm.MDLM_DIR

# What ``register()`` adds, registry by registry (each a name -> "module:attribute" or a loader).
REWARD_PATHS = {  # image, verifiable (shape_verifier.py): the shapes world's prompt checker, 0 / 1 and graded
    "shape_verifier": "unialign.embedded.shape_verifier:ShapeVerifierReward",
    "shape_verifier_partial": "unialign.embedded.shape_verifier:PartialShapeVerifierReward",
}
VIDEO_REWARD_PATHS = {  # video, verifiable (motion_world.py): the motion world's clip checker, 0 / 1 and graded
    "motion_verifier": "unialign.embedded.motion_world:MotionVerifierReward",
    "motion_verifier_partial": "unialign.embedded.motion_world:PartialMotionVerifierReward",
}
TEXT_REWARD_PATHS = {  # text, verifiable (vlm.py): the VLM task's one-word answers against the solution column
    "vlm_accuracy": "unialign.embedded.vlm:accuracy_reward",
}
GENEVAL_BACKEND_PATHS = {  # GenEval's rules on this world (geneval_shapes.py): get_reward("geneval", backend="shapes")
    "shapes": "unialign.embedded.geneval_shapes:ShapesDetector",
}


# arith is imported when first used: the loaders below run only when a script asks for the data set
# The rows are conversational (TRL's format: the question as a user message), so the policy renders them through
# the chat template the model was trained with; a plain string prompt would be used raw (TRL's rule).
def _user(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _arithmetic_rows(split: str, n: int | None = None) -> list[dict[str, Any]]:
    from unialign.embedded.arith import arithmetic_dataset

    return [{"prompt": _user(r["question"]), "answer": r["answer"]} for r in arithmetic_dataset(split, n=n)]


def _arithmetic_pairs(split: str, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    from unialign.embedded.arith import preference_pairs

    return [{**r, "prompt": _user(r["prompt"])} for r in preference_pairs(split, n=n, seed=seed)]


def _vlm_rows(split: str, n: int | None = None) -> list[dict[str, Any]]:
    from unialign.embedded.vlm import vlm_dataset

    return vlm_dataset(split, n=n)


def _vlm_pairs(split: str, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    from unialign.embedded.vlm import preference_pairs

    return preference_pairs(split, n=n, seed=seed)


def _vlm_video_rows(split: str, n: int | None = None) -> list[dict[str, Any]]:
    from unialign.embedded.vlm_video import video_dataset

    return video_dataset(split, n=n)


def _vlm_video_pairs(split: str, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    from unialign.embedded.vlm_video import preference_pairs

    return preference_pairs(split, n=n, seed=seed)


def register() -> None:
    """Add the demo worlds to the core registries (module docstring): ``NAME`` as a prompt data set and a
    pair data set, ``REWARD_PATHS`` as image rewards, ``GENEVAL_BACKEND_PATHS`` as GenEval backends; the VLM task
    (``vlm.py``) as ``VLM_NAME`` (prompt and pair data set, and a ``vlm_judge`` model name), its video task
    (``vlm_video.py``) as ``VLM_VIDEO_NAME`` (prompt and pair data set) and ``TEXT_REWARD_PATHS`` as text rewards. Idempotent;
    an entry someone registered under the same name first is kept (``setdefault``). Imports nothing heavy."""
    from unialign.rewards.geneval import GENEVAL_BACKENDS
    from unialign.rewards.registry import REWARD_INPUTS, REWARDS
    from unialign.rewards.vlm_judge import JUDGE_MODELS
    from unialign.text.data import NAMED_DATASETS, NAMED_PAIR_DATASETS

    for name, path in REWARD_PATHS.items():
        REWARDS.setdefault(name, path)
        REWARD_INPUTS.setdefault(name, "image")
    for name, path in VIDEO_REWARD_PATHS.items():
        REWARDS.setdefault(name, path)
        REWARD_INPUTS.setdefault(name, "video")
    for name, path in GENEVAL_BACKEND_PATHS.items():
        GENEVAL_BACKENDS.setdefault(name, path)
    NAMED_DATASETS.setdefault(NAME, _arithmetic_rows)
    NAMED_PAIR_DATASETS.setdefault(NAME, _arithmetic_pairs)
    for name, path in TEXT_REWARD_PATHS.items():
        REWARDS.setdefault(name, path)
        REWARD_INPUTS.setdefault(name, "text")
    NAMED_DATASETS.setdefault(VLM_NAME, _vlm_rows)
    NAMED_PAIR_DATASETS.setdefault(VLM_NAME, _vlm_pairs)
    NAMED_DATASETS.setdefault(VLM_VIDEO_NAME, _vlm_video_rows)
    NAMED_PAIR_DATASETS.setdefault(VLM_VIDEO_NAME, _vlm_video_pairs)
    JUDGE_MODELS.setdefault(VLM_NAME, {"model_name_or_path": str(VLM_DIR)})  # UNIALIGN_VLM_JUDGE=embedded-vlm


IMAGE_SD3_NAME = "embedded-sd3"  # the shapes world's flow-matching model (unialign.embedded.parts.NAME_SD3)
VIDEO_NAME = "embedded-wan"  # the motion world's text-to-video model (motion_world.py; = motion_world.NAME)
SHIPPED_MODELS = {"text": (NAME, MDLM_NAME), "vision": (VLM_NAME, VLM_VIDEO_NAME),
                  "image": (NAME, IMAGE_SD3_NAME, VIDEO_NAME)}  # by kind (a video model runs in the image scripts)
SCRIPTS_FOR = {"text": "scripts/grpo_math.py, dpo_text.py, ppo_rlhf.py and train_reward_model.py train text models",
               "vision": "scripts/grpo_vision.py (and dpo_text.py) train vision-language models",
               "image": "scripts/grpo_image.py, ddpo_aesthetic.py and dpo_sdxl.py train image models (grpo_video.py "
                        "and grpo_image.py text-to-video ones)"}


def check_model_kind(name: str, kinds: tuple[str, ...], field: str = "--model_name_or_path") -> None:
    """Before anything loads: a ``UserError`` (one line, exit 2) when a script that trains ``kinds`` of model
    (``"text"``, ``"vision"``, ``"image"``) is given another kind -- a shipped model of another kind by name, a
    local folder whose config says so (``unialign.hub.local_model_kind``) -- naming the scripts that train it, or
    a misspelt shipped model's name ("did you mean"), instead of a Hub or prompt-set error about something else."""
    from unialign.errors import UserError, did_you_mean
    from unialign.hub import KIND_WORDS, local_model_kind

    ours = tuple(dict.fromkeys(n for k in kinds for n in SHIPPED_MODELS[k]))
    if name in ours:
        return
    here = " or ".join(KIND_WORDS[k] + "s" for k in kinds)
    choices = f"give {', '.join(repr(n) for n in ours)}, a Hub id or a local folder"
    other = next((k for k, names in SHIPPED_MODELS.items() if name in names and k not in kinds), None)
    if other is not None:
        raise UserError(f"{field}: {name!r} is the shipped {KIND_WORDS[other]}; this script trains {here} "
                        f"({choices}); {SCRIPTS_FOR[other]}")
    local = local_model_kind(name)
    if local is not None and local[0] not in kinds:
        word = KIND_WORDS[local[0]]
        raise UserError(f"{field}: {name!r} is {'an' if word[0] in 'aeiou' else 'a'} {word} (its {local[1]} says so); this script "
                        f"trains {here}; {SCRIPTS_FOR[local[0]]}")
    if not Path(name).expanduser().exists() and "/" not in name:
        hint = did_you_mean(name, [n for names in SHIPPED_MODELS.values() for n in names])
        if hint:
            raise UserError(f"{field}: {name!r} is no local folder, no Hub id of the form 'org/name', and not a "
                            f"shipped model{hint}; {choices}")


def model_path(name_or_path: str) -> str:
    """``"embedded"`` -> the shipped arithmetic model's folder, ``"embedded-vlm"`` -> the shipped tiny VLM's,
    ``"embedded-vlm-video"`` -> its video extension's, ``"embedded-mdlm"`` -> the shipped masked-diffusion LM's;
    anything else unchanged."""
    return {NAME: str(ARITH_LM_DIR), VLM_NAME: str(VLM_DIR), VLM_VIDEO_NAME: str(VLM_VIDEO_DIR),
            MDLM_NAME: str(MDLM_DIR)}.get(name_or_path, name_or_path)


def load_arith_policy(**kwargs: Any):
    """The shipped arithmetic model as a ``CausalLMPolicy`` (``kwargs`` as ``CausalLMPolicy.from_pretrained``)."""
    from unialign.text.policy import CausalLMPolicy

    return CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR), **kwargs)
