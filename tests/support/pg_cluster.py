"""A private PostgreSQL cluster a test may stop and start (never the shared server).

`initdb` into a temporary directory as the `postgres` user (PostgreSQL refuses to run as
root, which CI is), listening on a free loopback port; `stop(mode="fast")` is PostgreSQL's
fast shutdown (sessions are terminated with 57P01, new ones refused with 57P03 while it
shuts down or starts up). Everything is removed at exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.servers import free_port

BIN_DIRS = [Path("/usr/lib/postgresql") / v / "bin" for v in ("17", "16", "15", "14")]


def _bin_dir() -> Path | None:
    configured = os.environ.get("ROLLTAP_TEST_PG_BIN")
    for candidate in ([Path(configured)] if configured else []) + BIN_DIRS:
        if (candidate / "initdb").exists():
            return candidate
    found = shutil.which("initdb")
    return Path(found).parent if found else None


class PrivatePostgres:
    def __init__(self, directory: Path, bin_dir: Path) -> None:
        self.directory = directory
        self.bin_dir = bin_dir
        self.port = free_port()
        self.data = directory / "data"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout_s: float = 120) -> None:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=timeout_s)

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c max_connections=50")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.directory / "log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    bin_dir = _bin_dir()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb) on this machine for a private cluster")
    directory = Path(tempfile.mkdtemp(prefix="rolltap-pg-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres")
    cluster = PrivatePostgres(directory, bin_dir)
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop("immediate")
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(directory, ignore_errors=True)
