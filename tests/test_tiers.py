"""The fast tier (``pytest -m "not slow"``, the edit-test loop) reaches every module of the package: each is imported
by a test file that has a fast test, or by a module such a file reaches (module-level, function-level, or named in a
registry's lazy ``"unialign.x.y:attr"`` string). Heavy tests -- model rebuilds, benchmark runs, the config snapshot,
script runs over a few seconds -- carry ``@pytest.mark.slow``; ``.ci/run`` runs both tiers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_import_boundaries import _import_graph

ROOT = Path(__file__).resolve().parents[1]
LAZY = re.compile(r"^(unialign(?:\.\w+)+)(?::\w+)?$")  # "unialign.rewards.reward_model:RewardModelReward"


def _is_slow(node: ast.AST) -> bool:
    return "mark.slow" in ast.unparse(node)


def fast_test_files(tests: Path) -> list[Path]:
    """Test files with at least one test not marked slow (neither by a decorator nor by a module ``pytestmark``)."""
    out = []
    for f in sorted(tests.rglob("test_*.py")):
        tree = ast.parse(f.read_text(), filename=str(f))
        if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
               and _is_slow(n.value) for n in tree.body):
            continue
        tests_ = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        if any(not any(_is_slow(d) for d in t.decorator_list) for t in tests_):
            out.append(f)
    return out


def _named_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports (any import statement) or names in a lazy registry string."""
    names: list[str] = []
    for n in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(n, ast.Import):
            names += [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            names += [n.module] + [f"{n.module}.{a.name}" for a in n.names]
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and LAZY.match(n.value):
            names.append(LAZY.match(n.value).group(1))
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def unreached_modules(root: Path = ROOT) -> list[str]:
    """The modules of ``root/unialign`` no fast test file reaches."""
    pkg = root / "unialign"
    graph = _import_graph(pkg)
    files = {m: pkg.parent / (m.replace(".", "/") + ".py") for m in graph}
    files = {m: f if f.exists() else f.with_suffix("") / "__init__.py" for m, f in files.items()}
    modules = set(graph)
    todo = [m for f in fast_test_files(root / "tests") for m in _named_modules(f, modules)]
    reached: set[str] = set()
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += [*graph[m], *_named_modules(files[m], modules)]
    return sorted(modules - reached)


def test_the_tier_checker_can_fail(tmp_path):
    pkg = tmp_path / "unialign"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("REGISTRY = {'x': 'unialign.c:thing'}\n")
    (pkg / "b.py").write_text("")
    (pkg / "c.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("from unialign import a\n\n\ndef test_a():\n    pass\n")
    (tmp_path / "tests" / "test_b.py").write_text("import pytest\nimport unialign.b\n\n\n@pytest.mark.slow\n"
                                                  "def test_b():\n    pass\n")
    assert unreached_modules(tmp_path) == ["unialign.b"]  # c is reached through a's registry string


def test_every_module_is_reached_by_the_fast_tier():
    assert len(fast_test_files(ROOT / "tests")) > 50
    missing = unreached_modules()
    assert not missing, "modules no fast test reaches (give one a fast test): " + ", ".join(missing)
