"""The sizes ``docs/design.md`` states, read from the tree: every "`NAME` (N lines)" in it, where NAME is a file
(``unialign/registry.py``), a folder (``unialign/text/``: its ``.py`` files), several of them joined by " + ", or a
class or function of the package (``SD1Family``: its definition, decorators included). ``tests/test_docs.py``
fails when a figure is stale;

    python -m tests.design_figures        # rewrites the figures in docs/design.md
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
FIGURE = re.compile(r"`([\w./+ ]+)` \((\d[\d,]*) lines\)")


def _file_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@cache
def _definitions() -> dict[str, list[int]]:
    """class / function name -> the line counts of every definition of that name in the package."""
    out: dict[str, list[int]] = {}
    for f in sorted((ROOT / "unialign").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                out.setdefault(node.name, []).append(node.end_lineno - start + 1)
    return out


def lines_of(name: str) -> int:
    """The line count of ``name`` (see the module docstring); a KeyError for a name that is none of them."""
    if " + " in name:
        return sum(lines_of(part.strip()) for part in name.split(" + "))
    path = ROOT / name
    if name.endswith("/") and path.is_dir():
        return sum(_file_lines(f) for f in sorted(path.rglob("*.py")))
    if path.is_file():
        return _file_lines(path)
    found = _definitions().get(name, [])
    if len(found) != 1:
        raise KeyError(f"docs/design.md: `{name}` is {'defined more than once' if found else 'no file, folder or definition'}")
    return found[0]


def refreshed(text: str) -> str:
    """``text`` with every figure set to what the tree has."""
    return FIGURE.sub(lambda m: f"`{m.group(1)}` ({lines_of(m.group(1)):,} lines)", text)


def stale(text: str) -> list[str]:
    """The figures of ``text`` that differ from the tree, as "`name`: says N, is M"."""
    return [f"`{m.group(1)}`: says {m.group(2)}, is {lines_of(m.group(1)):,}" for m in FIGURE.finditer(text)
            if int(m.group(2).replace(",", "")) != lines_of(m.group(1))]


if __name__ == "__main__":
    DESIGN.write_text(refreshed(DESIGN.read_text()))
    print(f"{DESIGN.relative_to(ROOT)}: {len(FIGURE.findall(DESIGN.read_text()))} figures from the tree")
