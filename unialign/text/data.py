"""Prompt datasets for text RL: hub ids, local json/jsonl/parquet files or the embedded task, validated.

Rows come out as ``{"prompt": ..., <other columns>}``; the other columns (e.g. ``answer``) reach the
reward functions as keyword arguments, TRL-style.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unialign.hub import HubUnavailableError, require_hub


def load_rows(name: str, split: str, config_name: str | None = None, n: int | None = None) -> list[dict[str, Any]]:
    """Rows of a dataset: ``"embedded"`` (the shipped arithmetic task), a local .json/.jsonl/.parquet
    file, or a Hugging Face Hub id (``datasets.load_dataset``; fails at once offline)."""
    if name == "embedded":
        from unialign.text.embedded import arithmetic_dataset

        return arithmetic_dataset(split, n=n)
    import datasets

    path = Path(name)
    try:
        if path.suffix in (".json", ".jsonl", ".parquet"):
            if not path.exists():
                raise FileNotFoundError(f"dataset file {name!r} does not exist")
            builder = "parquet" if path.suffix == ".parquet" else "json"
            ds = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
        else:
            require_hub(name, "dataset")
            ds = datasets.load_dataset(name, config_name, split=split)
    except (FileNotFoundError, HubUnavailableError):
        raise
    except Exception as err:  # noqa: BLE001 - hub / connection errors come in many types
        raise RuntimeError(
            f"could not load dataset {name!r} (split {split!r}): {type(err).__name__}: {str(err).splitlines()[0]}\n"
            "Datasets cannot be downloaded on this machine (offline). Pass a local .json/.jsonl/.parquet file "
            "with the same schema, or run where the Hugging Face Hub is reachable."
        ) from None
    rows = [dict(r) for r in ds]
    return rows[:n] if n else rows


def gsm8k_prompts(rows: list[dict[str, Any]], source: str = "dataset") -> list[dict[str, Any]]:
    """GSM8K schema (``question``, ``answer`` ending ``#### N``) -> ``{"prompt", "answer"}`` rows.
    Raises ValueError naming the first bad row and field."""
    out = []
    for i, row in enumerate(rows):
        for field in ("question", "answer"):
            value = row.get(field)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{source} row {i}: field {field!r} must be a non-empty string, got {value!r}")
        if "####" not in row["answer"]:
            raise ValueError(f"{source} row {i}: field 'answer' must end with '#### <number>' (GSM8K schema)")
        out.append({"prompt": row["question"], "answer": row["answer"]})
    if not out:
        raise ValueError(f"{source}: no rows")
    return out
