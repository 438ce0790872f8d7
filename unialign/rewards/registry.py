"""Built-in rewards by name, as a literal dict of ``"module:attribute"`` paths resolved on first use,
so naming a reward never imports open_clip / transformers until that reward is actually built.

A reward spec (``--reward_funcs``, ``get_reward``) is one of
  * a registered name (``REWARDS``),
  * TRL's dotted ``package.module.function`` (the current directory is importable, as in TRL),
  * ``package.module:function`` (``function`` may be dotted: ``Class.method``),
  * ``path/to/file.py:function``: the user's own file, executed on load like any module they import.

This module only resolves specs (``unialign.rewards.base.get_reward`` builds the reward). Each path names
either a reward *class* (a factory: ``get_reward`` instantiates it with the keyword arguments, and the
instance is the reward, e.g. a model-based reward that loads weights in ``__init__``) or a reward
*function* with TRL's signature (the keyword arguments are bound to every call). Other packages register
their own names by adding entries to ``REWARDS`` (the demo worlds' explicit ``register()`` adds their shape verifiers).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Any

REWARDS: dict[str, str] = {
    # text, verifiable (unialign/rewards/math.py)
    "math_accuracy": "unialign.rewards.math:math_accuracy_reward",
    "math_format": "unialign.rewards.math:math_format_reward",
    # text, learned (unialign/rewards/reward_model.py): get_reward("reward_model", path=...)
    "reward_model": "unialign.rewards.reward_model:RewardModelReward",
    # image (unialign/rewards/image.py): classes, instantiated with get_reward's kwargs
    "jpeg_compressibility": "unialign.rewards.image:JpegCompressibilityReward",
    "jpeg_incompressibility": "unialign.rewards.image:JpegIncompressibilityReward",
    "aesthetic": "unialign.rewards.image:AestheticReward",
    "clip_score": "unialign.rewards.image:ClipScoreReward",
    "pickscore": "unialign.rewards.image:PickScoreReward",
    "hps": "unialign.rewards.image:HpsReward",
    # image, verifiable (unialign/rewards/geneval.py): GenEval's compositional verifier, zero-shot detector + CLIP
    "geneval": "unialign.rewards.geneval:GenEvalReward",
    # any modality (unialign/rewards/pairwise.py): Pref-GRPO's win rate in the group under a pairwise judge
    "pairwise": "unialign.rewards.pairwise:PairwiseReward",
    "ocr": "unialign.rewards.ocr:OcrReward",  # unialign/rewards/ocr.py; needs the ocr extra
    # image, learned (unialign/rewards/vlm_judge.py): a VLM's P(yes) or its "Final Score: x" / 5
    "vlm_judge": "unialign.rewards.vlm_judge:VLMJudgeReward",
    # video (unialign/rewards/video.py): any image reward per frame, reduced; adjacent frames' agreement
    "per_frame": "unialign.rewards.video:PerFrameReward",
    "temporal_consistency": "unialign.rewards.video:TemporalConsistencyReward",
}  # other packages add their own entries (a name -> "module:attribute") when imported

# What each registered reward scores: "text" completions, "image" samples, "video" clips or "any" (a name missing
# here: any); several kinds joined by "|" ("image|video": the VLM judge reads a clip whole).
# The scripts offer (and accept) only the rewards of what they sample.
REWARD_INPUTS: dict[str, str] = {
    "math_accuracy": "text", "math_format": "text", "reward_model": "text", "jpeg_compressibility": "image",
    "jpeg_incompressibility": "image", "aesthetic": "image", "clip_score": "image", "pickscore": "image",
    "hps": "image", "geneval": "image", "ocr": "image", "pairwise": "any", "vlm_judge": "image|video",
    "per_frame": "video", "temporal_consistency": "video",
}


# What a script sampling the key also takes, lifted: a video script scores an image reward on every frame and
# reduces it per clip (``unialign.rewards.video.PerFrameReward``; the image scripts' ``--frame_reduction``).
LIFTED: dict[str, str] = {"video": "image"}


def accepted_inputs(modality: str) -> tuple[str, ...]:
    """The ``REWARD_INPUTS`` kinds a script sampling ``modality`` takes: its own, "any", and what it lifts."""
    return (modality, "any", *((LIFTED[modality],) if modality in LIFTED else ()))


def reward_inputs(name: str) -> tuple[str, ...]:
    """The kinds the reward ``name`` scores (``REWARD_INPUTS``, split at "|"; unregistered: "any")."""
    return tuple(REWARD_INPUTS.get(name, "any").split("|"))


def takes(name: str, modality: str) -> bool:
    """Whether a script sampling ``modality`` can use the reward ``name`` (directly, or lifted: ``LIFTED``)."""
    return bool(set(reward_inputs(name)) & set(accepted_inputs(modality)))


def lifted(name: str, modality: str) -> bool:
    """Whether the reward ``name`` scores ``modality`` samples only through ``LIFTED`` (an image reward on a clip:
    every frame, reduced)."""
    kinds = reward_inputs(name)
    return modality in LIFTED and modality not in kinds and "any" not in kinds and LIFTED[modality] in kinds


def rewards_for(modality: str) -> list[str]:
    """The registered rewards that score ``modality`` ("text" / "image" / "video") samples, sorted (a video's
    include the image rewards, scored per frame: ``LIFTED``)."""
    return sorted(n for n in REWARDS if takes(n, modality))


def resolve(path: str) -> Any:
    """Import ``"package.module:attribute"`` and return the attribute (ValueError on a malformed path)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"reward path must look like 'package.module:attribute', got {path!r}")
    obj = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


SPEC_FORMS = "'package.module.function', 'module:function' or 'path/to/file.py:function'"


def resolve_reward(spec: str) -> tuple[Any, str]:
    """The object a reward spec names (a function or a class, not yet instantiated) and its label (the
    registry name, else the attribute's name). Imports the module or runs the file; builds nothing.
    Raises ValueError naming the spec: unknown name (listing the registered ones), missing module, file
    or attribute, or a module that fails to import."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward: expected a registered name or {SPEC_FORMS}, got {spec!r}")
    spec = spec.strip()
    if spec in REWARDS:
        return resolve(REWARDS[spec]), spec
    if ":" in spec:
        source, _, attribute = spec.rpartition(":")  # rpartition: a Windows drive letter stays in the path
        is_file = source.endswith(".py") or "/" in source or os.sep in source
        module = _load_file(spec, source) if is_file else _import(spec, source)
    elif spec.endswith(".py"):
        raise ValueError(f"reward {spec!r}: name the function in the file too, as 'path/to/file.py:function'")
    elif "." in spec:
        source, _, attribute = spec.rpartition(".")  # TRL: the last dotted part is the function
        module = _import(spec, source)
    else:
        from unialign.errors import did_you_mean

        raise ValueError(f"unknown reward {spec!r}{did_you_mean(spec, REWARDS)}; registered: {', '.join(sorted(REWARDS))}; "
                         f"or give {SPEC_FORMS}")
    if not source or not attribute:
        raise ValueError(f"reward {spec!r}: expected a registered name or {SPEC_FORMS}")
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ValueError(f"reward {spec!r}: {source!r} has no attribute {attribute!r} "
                             f"(callables there: {', '.join(public[:20]) or 'none'})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: {attribute!r} is a {type(obj).__name__}, not a function or class")
    return obj, attribute.rpartition(".")[2]


def _import(spec: str, module_name: str):
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # TRL imports reward modules from the current directory
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ValueError(f"reward {spec!r}: no module named {err.name!r} (importable from {cwd}?; for a file "
                             "use 'path/to/file.py:function')") from None
        raise ValueError(f"reward {spec!r}: importing {module_name!r} failed: {err}") from err
    except Exception as err:  # the user's module raised while importing
        raise ValueError(f"reward {spec!r}: importing {module_name!r} failed: {type(err).__name__}: {err}") from err


def _load_file(spec: str, filename: str):
    path = Path(filename).expanduser()
    if not path.is_file():
        raise ValueError(f"reward {spec!r}: no such file {filename!r}")
    path = path.resolve()
    name = f"unialign_user_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"reward {spec!r}: running {str(path)!r} failed: {type(err).__name__}: {err}") from err
    return module


def required_init_args(cls: type) -> list[str]:
    """The arguments a reward class must be given (no default), e.g. ``["path"]`` for ``reward_model``."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
