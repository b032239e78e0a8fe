"""Agent keys in the database: create, list, revoke (the `rolltap-proxy keys` CLI) and load.

A key is `rk-` followed by 43 URL-safe characters (256 random bits); only its SHA-256 is
stored. A fast unsalted hash is enough for a random key of that length (nothing to guess,
nothing to look up in a table), and it lets the proxy find a key in one dict lookup.
The key itself is printed once, by `keys create`, and never stored or logged.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Table, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.db.engine import create_sync_db
from shared.db.migrate import upgrade
from shared.db.models import AgentKey as AgentKeyRow
from shared.settings import Settings
from shared.types import is_valid_id

__all__ = ["StoredKey", "cli", "ensure_key", "hash_key", "load_keys", "new_key"]

_TABLE = cast(Table, AgentKeyRow.__table__)  # a declarative model's table; typed as its base, FromClause


def new_key() -> str:
    return "rk-" + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class StoredKey:
    id: str
    key_hash: str
    rollout_prefix: str | None
    max_concurrency: int | None


async def load_keys(conn: AsyncConnection) -> list[StoredKey]:
    """Every key not revoked."""
    rows = await conn.execute(
        select(_TABLE.c.id, _TABLE.c.key_hash, _TABLE.c.rollout_prefix, _TABLE.c.max_concurrency)
        .where(_TABLE.c.revoked_at.is_(None)))
    return [StoredKey(*row) for row in rows]


async def ensure_key(conn: AsyncConnection, key: str, name: str) -> None:
    """Store `key` (unscoped) unless it is already there; an id derived from its hash keeps this idempotent."""
    digest = hash_key(key)
    found = await conn.execute(select(_TABLE.c.id).where(_TABLE.c.key_hash == digest))
    if found.first() is not None:
        return
    try:
        async with conn.begin_nested():
            await conn.execute(insert(_TABLE).values(id="cfg-" + digest[:12], key_hash=digest, name=name))
    except IntegrityError:
        pass  # another proxy process stored it first


def _create(conn: Any, name: str | None, rollout_prefix: str | None, max_concurrency: int | None) -> tuple[str, str]:
    key = new_key()
    key_id = "key-" + secrets.token_hex(6)
    conn.execute(insert(_TABLE).values(id=key_id, key_hash=hash_key(key), name=name, rollout_prefix=rollout_prefix,
                                       max_concurrency=max_concurrency))
    return key_id, key


def _prefix(value: str) -> str:
    if not is_valid_id(value):
        raise argparse.ArgumentTypeError("a rollout-id prefix is 1-128 characters of [A-Za-z0-9._:-]")
    return value


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def cli(argv: list[str]) -> int:
    """`rolltap-proxy keys create|list|revoke`; the database comes from `--db` or `ROLLTAP_DB__URL`."""
    parser = argparse.ArgumentParser(prog="rolltap-proxy keys", description="Manage agent API keys")
    parser.add_argument("--db", metavar="URL", help="database URL; env ROLLTAP_DB__URL")
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", help="create a key and print it (shown only this once)")
    create.add_argument("--name", help="a label for the key")
    create.add_argument("--rollout-prefix", type=_prefix,
                        help="the key may only touch rollouts whose id starts with this")
    create.add_argument("--max-concurrency", type=_positive,
                        help="relayed calls in flight for this key per proxy process (default: "
                             "proxy.limits.max_calls_per_key)")
    sub.add_parser("list", help="list keys (ids and scopes; never the keys)")
    revoke = sub.add_parser("revoke", help="revoke a key by id (proxies stop accepting it within keys_refresh_s)")
    revoke.add_argument("key_id")
    args = parser.parse_args(argv)
    # A dict, not a DbSettings: pydantic-settings merges it with the ROLLTAP_DB__* environment.
    overrides: dict[str, Any] = {"db": {"url": args.db}} if args.db else {}
    settings = Settings(**overrides)
    if settings.db.migrate_on_start:
        upgrade(settings.db)
    engine = create_sync_db(settings.db)
    try:
        with engine.begin() as conn:
            if args.command == "create":
                key_id, key = _create(conn, args.name, args.rollout_prefix, args.max_concurrency)
                print(f"id: {key_id}\nkey: {key}\n(the key is shown only now; store it in your agent's environment)")
            elif args.command == "list":
                rows = conn.execute(select(_TABLE).order_by(_TABLE.c.created_at, _TABLE.c.id)).mappings().all()
                print("id\tname\trollout_prefix\tmax_concurrency\tcreated_at\trevoked_at")
                for row in rows:
                    print("\t".join("-" if row[c] is None else str(row[c]) for c in
                                    ("id", "name", "rollout_prefix", "max_concurrency", "created_at", "revoked_at")))
            else:
                done = conn.execute(update(_TABLE).where(_TABLE.c.id == args.key_id, _TABLE.c.revoked_at.is_(None))
                                    .values(revoked_at=datetime.now(UTC)))
                if done.rowcount == 0:
                    print(f"no active key with id {args.key_id!r}")
                    return 1
                print(f"revoked {args.key_id}")
    finally:
        engine.dispose()
    return 0
