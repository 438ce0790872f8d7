"""Shared set-ups of the trainer tests: a disk that fills up, in a tmpfs or in the writes' ``os``."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` ("3m") mounted under ``tmp_path``; the test is skipped where mounting needs root."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def full_disk_os(keep: int):
    """A stand-in for ``unialign.files``' ``os`` whose ``write`` writes the first ``keep`` bytes, then runs out of
    space (ENOSPC); everything else is the real ``os``."""
    real_write = os.write

    class FullOS:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            real_write(fd, bytes(data[:keep]))
            raise OSError(errno.ENOSPC, "No space left on device")

    return FullOS()
