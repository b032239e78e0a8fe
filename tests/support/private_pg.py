"""A private PostgreSQL cluster (initdb in a temporary directory) that a test or bench may stop and start.

The shared server on 5432 must never be stopped; this one belongs to its caller alone.
Runs as the `postgres` user (via `runuser`) when started as root, as CI does.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from tests.support.servers import free_port


def _bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed")
    return found


class PrivatePostgres:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rolltap-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as_postgres:
            shutil.chown(self.root, "postgres")

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as_postgres, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def init(self) -> None:
        self._run(_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def start(self) -> None:
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "pg.log"), "-w", "-o",
                  f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=100", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def database(self, name: str) -> str:
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute(f'CREATE DATABASE "{name}"')
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        return self.url.rsplit("/", 1)[0] + "/" + name

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.root, ignore_errors=True)
