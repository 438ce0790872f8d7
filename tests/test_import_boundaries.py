"""Import directions (ARCHITECTURE.md, habit 3): algos -> torch / stdlib only; trainers never import a
modality library or a modality subpackage; ``import unialign`` stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "unialign"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _imports(path: Path, root: Path = PKG) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in ``path`` (a file of the package at
    ``root``), relative imports resolved."""
    package = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append((node.lineno, mod))
            if node.module is None or node.level:  # `from . import x` may import submodules
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def _is_under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def _py_files(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


def test_import_checker_can_fail(tmp_path):
    # the checker must see forbidden imports, including relative ones resolved to their full names
    src = "from .. import text\nfrom .kl import kl_estimate\nimport numpy as np\nfrom transformers import AutoModel\n"
    probe = tmp_path / "unialign" / "algos" / "x.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(src)
    mods = [m for _, m in _imports(probe, root=tmp_path / "unialign")]
    assert "unialign.text" in mods and "unialign.algos.kl" in mods and "numpy" in mods and "transformers" in mods


def test_algos_import_only_torch_stdlib_and_algos():
    files = _py_files("algos")
    assert files, "unialign/algos has no .py files"
    bad = []
    for f in files:
        for line, mod in _imports(f):
            top = mod.split(".")[0]
            ok = (
                top in STDLIB
                or _is_under(mod, "torch")
                or _is_under(mod, "unialign.algos")
                or _is_under(mod, "unialign.types")
            )
            if not ok:
                bad.append(f"{f.relative_to(PKG.parent)}:{line}: {mod}")
    assert not bad, "algos must import torch / stdlib / unialign.algos / unialign.types only:\n" + "\n".join(bad)


FORBIDDEN_IN_TRAINERS = ("transformers", "diffusers", "open_clip", "unialign.text", "unialign.image")


def test_trainers_do_not_import_modality_code():
    files = _py_files("trainers")
    if not files:
        pytest.skip("unialign/trainers has no .py files yet")
    bad = [
        f"{f.relative_to(PKG.parent)}:{line}: {mod}"
        for f in files
        for line, mod in _imports(f)
        if any(_is_under(mod, p) for p in FORBIDDEN_IN_TRAINERS)
    ]
    assert not bad, "trainers must not import modality libraries or subpackages:\n" + "\n".join(bad)


def test_import_unialign_is_light():
    code = (
        "import unialign, unialign.algos, sys; "
        "heavy = [m for m in ('transformers', 'diffusers', 'open_clip') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert res.returncode == 0, res.stderr
