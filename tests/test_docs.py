"""The documentation: a short README, links that resolve, a site that builds strictly, the CI command the README
shows, the algorithm page against the registry, and the quick start's Python API run as written."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title")
TEST_COMMAND_MARK = "# 2. install and run the whole test suite"


def prose(path: Path) -> str:
    """``path``'s Markdown without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """The anchor of a heading: Python-Markdown's ``toc`` slugify (what mkdocs checks), on the heading's text
    (code spans and emphasis as their text). For the ASCII headings the pages link to, GitHub's anchor is the same."""
    text = re.sub(r"[`*]", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", prose_keeping_headings(path), re.M)}


def prose_keeping_headings(path: Path) -> str:
    """Without fenced code blocks (a ``# comment`` in a bash block is no heading), inline code kept."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)


def readme_test_command() -> str:
    """The README's "install and run the whole test suite" command line (the line after its comment lines)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(TEST_COMMAND_MARK))
    return next(line for line in lines[i + 1:] if line.strip() and not line.startswith("#")).strip()


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/ (at most 250)"


def test_every_relative_link_points_to_an_existing_file():
    """Links and images of README.md and docs/*.md (outside code): a relative target must exist, and an anchor into
    a Markdown file must be one of its headings'. Cheap, no mkdocs needed; the strict site build checks the pages
    again its own way."""
    broken = []
    for page in [ROOT / "README.md", *PAGES]:
        for target in LINK.findall(prose(page)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading '#{anchor}' there)")
    assert not broken, "\n".join(broken)
    assert LINK.findall(prose(ROOT / "README.md")), "the README links to the docs"


def test_the_readme_links_every_page_of_the_site():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(prose(ROOT / "README.md"))}
    missing = [p.name for p in PAGES if p.resolve() not in linked and p.name != "index.md"]
    assert not missing, f"README.md does not link {missing}"


def test_ci_runs_the_readme_test_command_and_it_builds_the_docs_strictly():
    command = readme_test_command()
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8"), ".ci/run must run the README's command"
    assert command in (DOCS / "quickstart.md").read_text(encoding="utf-8"), "the quick start page shows the same"
    build = command[command.index("mkdocs build"):].split("&&")[0]
    assert "--strict" in build.split()
    # mkdocs' -q / --quiet silences the warnings that --strict counts, so a broken link would then pass
    assert not {"-q", "--quiet"} & set(build.split()), build


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs / mkdocs-material not installed (the dev extra installs them)")
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site"),
                           "-f", str(ROOT / "mkdocs.yml")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "trl_migration" / "index.html").is_file()


def test_the_algorithm_page_lists_each_presets_fields_as_the_registry_has_them():
    """docs/algorithms.md has a section per preset of ``unialign.registry.ALGORITHMS`` holding the fields the preset
    sets (those that differ from the spec's defaults), written as the registry's values."""
    from unialign.registry import ALGORITHMS, KNOBS

    text = (DOCS / "algorithms.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^### `([a-z0-9_]+)`\n(.*?)(?=^#{2,3} |\Z)", text, re.M | re.S))
    assert set(sections) == set(ALGORITHMS), f"presets without a section / sections without a preset: " \
                                             f"{set(ALGORITHMS) ^ set(sections)}"
    for name, spec in ALGORITHMS.items():
        fields = [f for f in dataclasses.fields(spec) if f.name in KNOBS]
        changed = ", ".join(f"{f.name}={getattr(spec, f.name)!r}" for f in fields if getattr(spec, f.name) != f.default)
        assert f"`{changed}`" in sections[name], f"docs/algorithms.md, {name}: expected the fields `{changed}`"


@pytest.mark.slow
def test_the_quick_start_python_api_runs_as_written(tmp_path, monkeypatch):
    """The two examples of docs/quickstart.md's "Python API" (2 steps each on the shipped arithmetic model)."""
    text = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    start = text.index("## Python API")
    end = text.find("\n## ", start + 1)
    section = text[start:] if end < 0 else text[start:end]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) == 2 and "OnlineTrainer(" in blocks[0] and "PreferenceTrainer(" in blocks[1]
    monkeypatch.chdir(tmp_path)
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/quickstart.md (Python API, example {i + 1})", "exec"), {})  # noqa: S102 - our own docs
    assert (tmp_path / "out" / "grpo" / "final" / "config.json").is_file()
    assert (tmp_path / "out" / "dpo" / "final" / "config.json").is_file()


def test_every_promise_in_reliability_names_a_test_that_exists():
    text = (DOCS / "reliability.md").read_text(encoding="utf-8")
    named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", text)
    assert len(named) >= 40
    for path, name in named:
        source = (ROOT / path).read_text(encoding="utf-8")
        assert not name or re.search(rf"^def {name}\(", source, flags=re.M), f"{path}::{name} does not exist"


def test_the_design_pages_figures_are_the_trees():
    """Every "`NAME` (N lines)" of docs/design.md is the tree's count (``tests/design_figures.py``); a stale one
    fails, naming it (regenerate with ``python -m tests.design_figures``)."""
    import inspect

    from tests.design_figures import DESIGN, FIGURE, stale
    from unialign.image.policy import SD1Family

    text = DESIGN.read_text()
    assert len(FIGURE.findall(text)) >= 40
    assert stale("`unialign/registry.py` (3 lines), `SD1Family` (1 lines)") == [  # counted here another way
        f"`unialign/registry.py`: says 3, is {len((ROOT / 'unialign/registry.py').read_text().splitlines()):,}",
        f"`SD1Family`: says 1, is {len(inspect.getsourcelines(SD1Family)[0])}"]
    assert not stale(text), "docs/design.md: stale figures (python -m tests.design_figures): " + "; ".join(stale(text))
