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


FORBIDDEN_IN_TRAINERS = ("transformers", "diffusers", "open_clip", "unialign.text", "unialign.image", "unialign.vision",
                         "unialign.dlm")
ALLOWED_IN_TRAINERS = ("transformers.optimization",)  # learning-rate schedules (get_scheduler): no model code


def test_trainers_do_not_import_modality_code():
    files = _py_files("trainers")
    if not files:
        pytest.skip("unialign/trainers has no .py files yet")
    bad = [
        f"{f.relative_to(PKG.parent)}:{line}: {mod}"
        for f in files
        for line, mod in _imports(f)
        if any(_is_under(mod, p) for p in FORBIDDEN_IN_TRAINERS) and not any(_is_under(mod, p) for p in ALLOWED_IN_TRAINERS)
    ]
    assert not bad, "trainers must not import modality libraries or subpackages:\n" + "\n".join(bad)


MODALITIES = ("text", "image", "vision", "dlm")
ABOVE_MODALITIES = ("unialign.trainers", "unialign.recipes", "unialign.trl")  # they run a modality; never the reverse


def _upward_imports(root: Path = PKG) -> list[str]:
    return [f"{f.relative_to(root.parent)}:{line}: {mod}" for sub in MODALITIES for f in sorted((root / sub).rglob("*.py"))
            for line, mod in _imports(f, root) if any(_is_under(mod, p) for p in ABOVE_MODALITIES)]


def test_modalities_never_import_trainers_or_recipes(tmp_path):
    """A modality (text, image, vision) sits beside the trainers, below the recipes that join them: no import of
    ``unialign.trainers``, ``unialign.recipes`` or ``unialign.trl``, at module level or inside a function. The
    checker is shown to fail on a probe package first."""
    probe = tmp_path / "unialign"
    for sub in MODALITIES:
        (probe / sub).mkdir(parents=True)
    (probe / "image" / "x.py").write_text("def f():\n    from unialign.trainers import finish_run\n")
    (probe / "vision" / "y.py").write_text("from ..recipes import text\n")
    assert _upward_imports(probe) == ["unialign/image/x.py:2: unialign.trainers", "unialign/vision/y.py:1: unialign.recipes",
                                      "unialign/vision/y.py:1: unialign.recipes.text"]
    bad = _upward_imports()
    assert not bad, "modalities must not import trainers or recipes:\n" + "\n".join(bad)


@pytest.mark.slow
def test_import_unialign_is_light():
    code = (
        "import unialign, unialign.algos, sys; "
        "heavy = [m for m in ('transformers', 'diffusers', 'open_clip') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- import cycles and the demo package
def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: Path = PKG) -> dict[str, dict[str, int]]:
    """module -> {imported module of the same package: line}, for every import statement anywhere in a
    module (module level or inside a function). ``from X import a`` is an edge to ``X.a`` when that is a
    module of the package, else to ``X``; relative names are resolved."""
    files = {_module_name(f, root): f for f in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a package: its nearest module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, {}))))
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_cycle_checker_can_fail(tmp_path):
    # a cycle through a function-level relative import and a `from package import module` is found
    pkg = tmp_path / "unialign"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from unialign.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("import unialign.a\n")
    (pkg / "d.py").write_text("from unialign.a import x\n")
    graph = _import_graph(pkg)
    assert graph["unialign.a"] == {"unialign.sub.b": 1} and graph["unialign.sub.b"] == {"unialign.c": 2}
    cycle = _find_cycle(graph)
    assert cycle is not None and set(cycle) == {"unialign.a", "unialign.sub.b", "unialign.c"}
    (pkg / "c.py").write_text("import os\n")
    assert _find_cycle(_import_graph(pkg)) is None


def test_no_import_cycles_in_unialign():
    graph = _import_graph()
    assert "unialign.rewards.base" in graph and graph["unialign.rewards.base"], "the graph is empty"
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle (function-level imports count): " + _describe(cycle, graph)


def test_core_never_imports_or_names_the_demo_package():
    """The demo worlds live in unialign/embedded (their assets too); no module outside it imports it or
    tests for the word "embedded" (scripts and the package itself resolve it)."""
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        if _is_under(_module_name(f, PKG), "unialign.embedded"):
            continue
        bad += [f"{f.relative_to(PKG.parent)}:{line}: imports {mod}" for line, mod in _imports(f)
                if _is_under(mod, "unialign.embedded")]
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Constant) and node.value == "embedded":
                bad.append(f"{f.relative_to(PKG.parent)}:{node.lineno}: the string 'embedded'")
    assert not bad, "core modules must not depend on the demo package:\n" + "\n".join(bad)
    assert not (PKG / "assets").exists() and (PKG / "embedded" / "assets" / "arith_lm" / "config.json").is_file()


# ---------------------------------------------------------------- the demo worlds' fields
# Words a demo world uses that the core uses too, each in its own meaning; every other name below is the demo's.
SHARED_WORDS = {
    "all": "the verifier protocol's verdict, defined by the core (unialign.image.evaluate.sample_scores)",
    "prompt": "every row's prompt column", "image": "a modality and a row column", "score": "every reward's score",
    "size": "PIL's Image.size and open_clip's preprocess 'size'", "box": "every detector's box (rewards/detection.py)",
    "question": "GSM8K's schema", "answer": "GSM8K's schema",
    "chosen": "TRL's preference format", "rejected": "TRL's preference format",
}
ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")  # their name argument is a Python attribute (t.shape)


def _demo_names() -> set[str]:
    """The names the demo worlds define, read from the demo package itself: the fields of the shapes world's
    samples, prompts and verifier readings, what its verifier returns, the arithmetic rows' and pairs' columns,
    and the names ``register()`` adds to the core registries; minus ``SHARED_WORDS``."""
    import dataclasses

    import unialign.embedded as demo
    from unialign.embedded import arith, shape_verifier, shapes_world

    names = {f.name for cls in (shapes_world.ShapeSample, shape_verifier.ShapePrompt, shape_verifier.Reading)
             for f in dataclasses.fields(cls)}
    sample = shapes_world.shape_dataset("train", per_prompt=1)[0]
    names |= set(shape_verifier.verify([sample.prompt], [sample.image]))
    names |= set(arith.arithmetic_dataset("test", n=1)[0]) | set(arith.preference_pairs("test", n=1)[0])
    names |= {demo.NAME, *demo.REWARD_PATHS, *demo.GENEVAL_BACKEND_PATHS}
    return names - set(SHARED_WORDS)


def _names_in(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string constant of ``path`` equal to one of ``names`` -- a subscript, a dict key, a
    ``.get`` argument, a comparison, a tuple of keys -- except the name argument of ``getattr`` and its kin."""
    tree = ast.parse(path.read_text(), filename=str(path))
    attribute_names = {id(node.args[1]) for node in ast.walk(tree) if isinstance(node, ast.Call)
                       and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_CALLS and len(node.args) > 1}
    return sorted((node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and node.value in names and id(node) not in attribute_names)


def test_demo_field_checker_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def f(row, checks, t):\n    a = row["colour"] + checks.get("credit")\n'
                     '    b = {k: 1 for k in checks if k not in ("all", "invalid")}\n'
                     '    return a, b, getattr(t, "shape", ()), "a shape on a background"\n')
    names = _demo_names()
    assert {"shape", "colour", "background", "credit", "invalid", "shape_verifier", "shapes", "embedded"} <= names
    assert not names & {"all", "prompt", "score", "question", "answer"}
    assert _names_in(probe, names) == [(2, "colour"), (2, "credit"), (3, "invalid")]


def test_core_never_names_a_demo_worlds_fields():
    """No module outside unialign/embedded names a field of a demo world (the shapes world's shape, colour,
    background, size words, its verifier's parts, credit and invalid flags, the names its registration adds): the
    demo hands the core callables and rows (a verifier returning ``all`` and its parts, a gold score, registered
    rewards), and the core reads them without knowing their names."""
    names = _demo_names()
    bad = [f"{f.relative_to(PKG.parent)}:{line}: {name!r}" for f in sorted(PKG.rglob("*.py"))
           if not _is_under(_module_name(f, PKG), "unialign.embedded") for line, name in _names_in(f, names)]
    assert not bad, "core modules must not name a demo world's fields:\n" + "\n".join(bad)
