"""A value from YAML or the command line as a config field's type (a module of its own that imports nothing of
unialign, so ``unialign.config`` and ``unialign.trl_compat`` can both use it)."""

from __future__ import annotations

from typing import Any


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1", "y", "on"):
        return True
    if text in ("false", "no", "0", "n", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def convert(value: Any, base: type | None, optional: bool) -> Any:
    """``value`` (from YAML or the command line) as the field's type; ValueError when it is not one.
    A string 'none' / 'null' is None for an optional non-string field."""
    if value is None:
        if optional or base is None:
            return None
        raise ValueError("must not be empty (null)")
    if optional and base is not str and isinstance(value, str) and value.strip().lower() in ("none", "null"):
        return None
    if base is None:
        return value
    if base is bool:
        return _to_bool(value)
    if base is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            return int(value) if not isinstance(value, str) else int(value.strip())
        except (TypeError, ValueError):
            raise ValueError(f"expected an integer, got {value!r}") from None
    if base is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {value!r}") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # YAML `train_split: 2023`
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r} ({type(value).__name__})")
    return value
