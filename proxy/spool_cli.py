"""`rolltap-proxy spool list|replay`: the dead-letter spool, for a human, once the cause is fixed.

A record lands in `<spool_dir>/dead/` only when the database refused that row for a reason a
retry cannot fix (outages are retried by the proxy itself). `list` shows each one (call,
attempt, why) and the batches still waiting for an outage to end; `replay` writes the dead
records to the database, each exactly once (a call already there is skipped, by `call_id`),
clears their `undurable_calls` rows in the same transaction, and only then deletes the file.
A record that is still refused stays where it is, and the command exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from proxy.recorder import DEAD_REASON, Spool
from proxy.store import dumps_json, remove_undurable_sync, write_calls_sync
from shared.db.engine import create_sync_db
from shared.settings import Settings
from shared.types import CallRecord

__all__ = ["spool_main"]


def _parse(argv: list[str]) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(prog="rolltap-proxy spool", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["list", "replay"])
    parser.add_argument("--spool-dir", help="the proxy's spool directory; env ROLLTAP_PROXY__RECORDER__SPOOL_DIR")
    parser.add_argument("--db", metavar="URL", help="database URL (replay); env ROLLTAP_DB__URL")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.spool_dir is not None:
        overrides["proxy"] = {"recorder": {"spool_dir": args.spool_dir}}
    if args.db is not None:
        overrides["db"] = {"url": args.db}
    return args, Settings(**overrides)


def _list(spool_dir: Path) -> int:
    dead = Spool(spool_dir / "dead").files()
    pending = Spool(spool_dir).files()
    print(f"dead-letter records: {len(dead)} (in {spool_dir / 'dead'})")
    for path in dead:
        for line in Spool.read_lines(path):
            attempt = f"{line.get('rollout_id')}/{line.get('attempt_id')}" if line.get("rollout_id") else "untracked"
            print(f"  {path.name}  {line['call_id']}  {attempt}  {line.get('route')}  {line.get(DEAD_REASON)}")
    waiting = sum(len(Spool.read_lines(p)) for p in pending)
    print(f"outage batches waiting: {len(pending)} ({waiting} records; the proxy writes them itself)")
    return 0


def _replay(settings: Settings) -> int:
    files = Spool(settings.proxy.recorder.spool_dir / "dead").files()
    engine = create_sync_db(settings.db, json_serializer=dumps_json)
    written = skipped = failed = 0
    try:
        for path in files:
            records: list[CallRecord] = Spool.read(path)
            try:
                with engine.begin() as conn:
                    inserted = write_calls_sync(conn, records, skip_existing=True)
                    remove_undurable_sync(conn, [r.call_id for r in records])
            except Exception as exc:  # noqa: BLE001 - reported; the file stays for the next try
                failed += len(records)
                print(f"still refused: {path.name}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}",
                      file=sys.stderr)
                continue
            path.unlink()  # after the commit: a crash in between replays it again, and it is skipped
            written += inserted
            skipped += len(records) - inserted
    finally:
        engine.dispose()
    print(f"replayed: {written} written, {skipped} already in the database, {failed} still refused")
    return 1 if failed else 0


def spool_main(argv: list[str]) -> int:
    args, settings = _parse(argv)
    if args.action == "list":
        return _list(settings.proxy.recorder.spool_dir)
    return _replay(settings)
