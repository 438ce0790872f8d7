"""The scripts' argument groups whose defaults are the shipped demo worlds (``NAME``), composed like the groups
of ``unialign.recipes.args`` (put them first among a config's bases):

    EmbeddedTaskArgs  --model_name_or_path / --dataset_name defaulting to the shipped arithmetic world
    EmbeddedPairArgs  the same and --max_completion_length, for the pair scripts (DPO, reward model)

and ``tuned_for``: a script's values measured on the shipped models, as its ``MODEL_DEFAULTS`` (they apply to those
models only; any other model keeps the script's defaults, TRL's where TRL has the field: ``unialign.config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unialign.config import arg
from unialign.embedded import (
    ARITH_LM_DIR,
    MDLM_DIR,
    MDLM_NAME,
    NAME,
    VLM_DIR,
    VLM_NAME,
    VLM_VIDEO_DIR,
    VLM_VIDEO_NAME,
)

FOLDERS = {NAME: ARITH_LM_DIR, MDLM_NAME: MDLM_DIR, VLM_NAME: VLM_DIR, VLM_VIDEO_NAME: VLM_VIDEO_DIR}  # each shipped text model's folder


def tuned_for(names: tuple[str, ...], values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``MODEL_DEFAULTS`` giving ``values`` to each shipped model of ``names``, by name and by its folder (the Python
    API is given the folder: ``unialign.embedded.ARITH_LM_DIR``)."""
    return {key: dict(values) for n in names for key in (n, str(FOLDERS[n]))}


@dataclass
class EmbeddedTaskArgs:
    """A text script's model and data, by default the shipped arithmetic world ('embedded'). Put it first among the
    bases: it declares again fields of ``TextModelArgs`` / ``TextDataArgs``."""

    model_name_or_path: str = arg(NAME, f"Hub id, local directory, or {NAME!r} (the shipped arithmetic model)",
                                  group="model")
    dataset_name: str = arg(NAME, f"{NAME!r} (the shipped arithmetic task), a Hub id, a local .jsonl/.json/"
                            ".parquet file, or a folder of split files (train.jsonl, test.jsonl, ...)", group="data")


@dataclass
class EmbeddedPairArgs(EmbeddedTaskArgs):
    """``EmbeddedTaskArgs`` and the longest completion of a preference pair."""

    max_completion_length: int | None = arg(1024, "longest chosen / rejected completion in tokens (EOS included); "
                                            "longer pairs are refused", group="data", min=1)
