"""``unialign``'s public namespace is exactly its ``__all__``: what ``dir()`` lists, what ``import *`` binds, and
every name in it resolves."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dir_and_star_import_are_all():
    code = (
        "import unialign, types; "
        "assert dir(unialign) == sorted(unialign.__all__), sorted(set(dir(unialign)) ^ set(unialign.__all__)); "
        "ns = {}; exec('from unialign import *', ns); ns.pop('__builtins__'); "
        "assert sorted(ns) == sorted(unialign.__all__), sorted(set(ns) ^ set(unialign.__all__)); "
        "public = {k for k, v in vars(unialign).items() if not k.startswith('_') and not isinstance(v, types.ModuleType)}; "
        "assert public <= set(unialign.__all__), public - set(unialign.__all__)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr


def test_every_public_name_resolves():
    import unialign

    for name in unialign.__all__:
        assert getattr(unialign, name) is not None, name
    public = {k for k, v in vars(unialign).items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public <= set(unialign.__all__), public - set(unialign.__all__)
    assert dir(unialign) == sorted(unialign.__all__)
