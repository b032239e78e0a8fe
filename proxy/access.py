"""Who may call: agent keys (cached in-process), their rollout scope, and calls in flight per key.

The hot path reads a dict: `authenticate` hashes the presented key and looks the hash up
in a cache of the database's keys, reloaded every `proxy.keys_refresh_s` by a background
task (so a revoked key stops working within that time). An unknown key triggers one
reload, at most once a second whoever asks, so a key created a moment ago works within a
second and a flood of wrong keys costs the database one query a second.

Keys arrive as OpenAI clients send them (`Authorization: Bearer <key>`) or as the
Anthropic SDK does (`x-api-key: <key>`). Untracked `/v1` calls carry no rollout, so
they need an unscoped key. With `proxy.open_access` nothing is checked. This module
never logs a key, a hash or a header value.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from proxy.keystore import StoredKey, hash_key, load_keys
from shared.errors import Forbidden, ServiceUnavailable, TooManyRequests, Unauthorized
from shared.settings import ProxySettings

__all__ = ["AgentKey", "KeyRing", "Slots", "credential"]

logger = logging.getLogger(__name__)

_MISS_RELOAD_S = 1.0


@dataclass(frozen=True, slots=True)
class AgentKey:
    id: str
    key_hash: str
    rollout_prefix: str | None
    max_concurrency: int

    def covers(self, rollout_id: str | None) -> bool:
        """Untracked calls (no rollout) need an unscoped key; a scoped key covers its prefix only."""
        if self.rollout_prefix is None:
            return True
        return rollout_id is not None and rollout_id.startswith(self.rollout_prefix)


def credential(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The agent key from raw ASGI headers: `x-api-key` if sent, else `authorization: Bearer ...`.

    `x-api-key` wins so a caller can hold an agent key there and an admin token in
    `authorization` (admin routes read only the latter).
    """
    bearer = None
    for name, value in headers:
        if name == b"x-api-key" and value.strip():
            return value.strip().decode("latin-1")
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                bearer = token.strip().decode("latin-1")
    return bearer


class KeyRing:
    def __init__(self, settings: ProxySettings, reader: AsyncEngine) -> None:
        self.is_open = settings.open_access
        self._default_cap = settings.limits.max_calls_per_key
        self._refresh_s = settings.keys_refresh_s
        self._reader = reader
        self._by_hash: dict[str, AgentKey] = {}
        self._loaded_at = 0.0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.is_open:
            logger.warning("open access: relayed, reward, finish and read routes accept calls without an agent "
                           "key (proxy.open_access); never expose this proxy beyond a trusted network")
            return
        await self.reload()
        logger.info("agent keys: %d active", len(self._by_hash))
        self._task = asyncio.create_task(self._refresh_loop(), name="rolltap-keys")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def reload(self) -> None:
        async with self._reader.connect() as conn:
            stored = await load_keys(conn)
        self._by_hash = {k.key_hash: self._cached(k) for k in stored}
        self._loaded_at = time.monotonic()

    def _cached(self, key: StoredKey) -> AgentKey:
        return AgentKey(key.id, key.key_hash, key.rollout_prefix, key.max_concurrency or self._default_cap)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.reload()
            except Exception as exc:  # noqa: BLE001 - keep the last good keys while the database is away
                logger.warning("agent keys not reloaded (keeping %d cached): %s", len(self._by_hash),
                               exc.__class__.__name__)

    async def _lookup_missing(self, digest: str) -> AgentKey | None:
        async with self._lock:
            if time.monotonic() - self._loaded_at >= _MISS_RELOAD_S:
                try:
                    await self.reload()
                except Exception as exc:  # noqa: BLE001 - an unreachable database means "unknown key" now
                    logger.warning("agent keys not reloaded: %s", exc.__class__.__name__)
        return self._by_hash.get(digest)

    async def authenticate(self, headers: Iterable[tuple[bytes, bytes]], rollout_id: str | None) -> AgentKey | None:
        """The caller's key, checked against the rollout; None with open access. Raises 401/403."""
        if self.is_open:
            return None
        key = credential(headers)
        if key is None:
            raise Unauthorized("missing agent key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                               code="missing_api_key")
        digest = hash_key(key)
        agent = self._by_hash.get(digest)
        if agent is None:
            agent = await self._lookup_missing(digest)
        # The dict finds the entry by hash; the compare is constant-time for form's sake (a
        # caller cannot steer a SHA-256 digest towards a stored one).
        if agent is None or not hmac.compare_digest(agent.key_hash, digest):
            raise Unauthorized("invalid or revoked agent key", code="invalid_api_key")
        if not agent.covers(rollout_id):
            scope = f"rollouts starting with {agent.rollout_prefix!r}"
            target = f"rollout {rollout_id!r}" if rollout_id is not None else "untracked /v1 calls"
            raise Forbidden(f"agent key {agent.id} covers {scope}, not {target}", code="key_scope")
        return agent


class Slots:
    """Relayed calls in flight: per key (429) and in all (503 with Retry-After), on this process."""

    def __init__(self, max_in_flight: int) -> None:
        self._max = max_in_flight
        self.in_flight = 0
        self._per_key: dict[str, int] = {}

    def take(self, key: AgentKey | None) -> None:
        if self.in_flight >= self._max:
            raise ServiceUnavailable(f"the proxy has {self.in_flight} calls in flight, its limit "
                                     "(proxy.limits.max_calls_in_flight); retry", code="proxy_busy", retry_after_s=1.0)
        if key is not None:
            held = self._per_key.get(key.id, 0)
            if held >= key.max_concurrency:
                raise TooManyRequests(f"agent key {key.id} has {held} calls in flight, its limit; retry when one "
                                      "ends", code="key_concurrency", retry_after_s=1.0)
            self._per_key[key.id] = held + 1
        self.in_flight += 1

    def give(self, key: AgentKey | None) -> None:
        self.in_flight -= 1
        if key is not None:
            held = self._per_key[key.id] - 1
            if held:
                self._per_key[key.id] = held
            else:
                del self._per_key[key.id]
