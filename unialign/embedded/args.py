"""The scripts' argument groups whose defaults are the shipped demo worlds (``NAME``), composed like the groups
of ``unialign.recipes.args`` (put them first among a config's bases):

    EmbeddedTaskArgs  --model_name_or_path / --dataset_name defaulting to the shipped arithmetic world
    EmbeddedPairArgs  the same and --max_completion_length, for the pair scripts (DPO, reward model)
"""

from __future__ import annotations

from dataclasses import dataclass

from unialign.config import arg
from unialign.embedded import NAME


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
