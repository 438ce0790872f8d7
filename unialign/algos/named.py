"""The two rules every table of named variants keeps (advantage estimators, policy losses, pair losses): a name is
registered once, and an unknown name is refused naming the registered ones."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def add_new(table: dict[str, Any], name: str, entry: Any, what: str) -> None:
    """``table[name] = entry``; a ValueError when ``name`` (a ``what``) is already registered."""
    if name in table:
        raise ValueError(f"{what} {name!r} is already registered")
    table[name] = entry


def lookup(table: dict[str, T], name: str, what: str) -> T:
    """``table[name]``; a ValueError naming the registered ``what`` names otherwise."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}")
    return table[name]
