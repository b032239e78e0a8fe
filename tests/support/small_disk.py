"""A real, small filesystem that a test fills and frees: the proxy's disk running out of space.

A tmpfs of a few MiB mounted under the test's directory (mounting needs root, as CI runs). A
test that needs one and cannot mount it is skipped with the reason shown, never silently.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["SmallDisk", "small_disk"]


class SmallDisk:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._filler = path / ".filler"

    def fill(self) -> None:
        """Take every free byte (in ever smaller writes, down to one byte)."""
        with open(self._filler, "ab", buffering=0) as fh:
            block = 1 << 20
            while block:
                try:
                    fh.write(b"\0" * block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    block //= 2

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)

    @property
    def free_bytes(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize


@contextmanager
def small_disk(path: Path, size: str = "8m") -> Iterator[SmallDisk]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a real full disk (needs root; CI runs as root): "
                    f"{mounted.stderr.strip()}")
    try:
        yield SmallDisk(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
