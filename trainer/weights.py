"""Pushing a new policy to every replica the proxy knows, then making it the active policy.

Two ways, measured on vLLM's own server (ARCHITECTURE.md, "Weight push"):
- LoRA (replicas started with `--enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`):
  `POST /v1/load_lora_adapter` under a new name per version (`policy-vN`); the last
  `keep_loaded` versions stay loaded so calls in flight finish on the version they began.
- Full weights (replicas with `VLLM_SERVER_DEV_MODE=1`): the proxy pauses admission and
  waits for calls in flight, then per replica `/pause?mode=wait`, the new weights loaded
  (below), `/reset_prefix_cache`, `/resume`; the proxy resumes.
Every replica call goes through the proxy's admin API (`POST /admin/replicas/control`), so
the trainer needs the proxy and its admin token, never a route to the replicas.
A replica takes one mode, not both; the proxy knows each replica's mode and the push
refuses a mode the replicas were not started for. A replica that fails the push is
drained through the proxy: never left serving an old policy silently. Only then does the
proxy's active policy move, so new calls are served by, and stamped with, the new version.

How a LoRA adapter reaches the replicas (`trainer.lora_transport`):
- `path`: `load_lora_adapter` with the exported folder's path, which each replica must read at
  that path (one machine, or a shared volume).
- `bytes`: the folder travels once per push, as an uncompressed tar with its SHA-256, to the
  proxy (`PUT /admin/adapters/{name}`), which stores it in the database; then per replica the
  admin control action `resolve_lora_adapter` makes vLLM ask the Rolltap plugin (`rolltap_vllm`,
  installed beside vLLM), which fetches it from the proxy by name, checks the digest and unpacks
  it locally. No replica reads the trainer's folders.
How full weights reach the replicas (`trainer.weight_transfer`):
- `disk`: as above, `reload_weights` from the exported folder, which each replica must read.
- `ipc` / `shm`: in memory, through vLLM's weight-transfer engine (replicas started with
  `--weight-transfer-config`): per replica `start_weight_update`, `update_weights` with what
  `trainer/transfer.py` staged (CUDA IPC handles, or a host shared-memory segment), then
  `finish_weight_update`, in place of `reload_weights`; no folder is written or read.
"""

from __future__ import annotations

import hashlib
import io
import logging
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

__all__ = ["PushError", "PushResult", "WeightPusher", "adapter_archive", "lora_name"]

logger = logging.getLogger(__name__)

WeightMode = Literal["lora", "full"]
LoraTransport = Literal["path", "bytes"]


class PushError(RuntimeError):
    """The push could not be done (wrong mode, no replica took it, proxy refused)."""


def lora_name(version: int) -> str:
    return f"policy-v{version}"


@dataclass
class PushResult:
    version: int
    served_name: str
    mode: WeightMode
    pushed: list[str] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)
    seconds: float = 0.0
    uploaded_bytes: int = 0  # the adapter's archive sent to the proxy (`bytes` transport)
    staged_s: float = 0.0  # gathering full weights for an in-memory push, before the pause (in `seconds`)


class WeightPusher:
    def __init__(self, proxy_url: str, admin_token: str, *, keep_loaded: int = 3, timeout_s: float = 120.0,
                 lora_transport: LoraTransport = "path") -> None:
        self._proxy = proxy_url.rstrip("/")
        self._headers = {"authorization": f"Bearer {admin_token}"}
        self._keep_loaded = keep_loaded
        self._lora_transport = lora_transport
        self._http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the proxy's view ----------------------------------------------------------------

    def _admin(self, method: str, path: str, **kwargs: Any) -> Any:
        kwargs.setdefault("headers", self._headers)
        r = self._http.request(method, f"{self._proxy}/admin{path}", **kwargs)
        if r.status_code >= 400:
            raise PushError(f"proxy {method} /admin{path}: {r.status_code} {r.text}")
        return r.json()

    def replicas(self, mode: WeightMode) -> list[dict[str, Any]]:
        """Replicas of the proxy, checked to all take `mode`."""
        replicas: list[dict[str, Any]] = self._admin("GET", "/replicas")["data"]
        if not replicas:
            raise PushError("the proxy has no replicas to push to")
        wrong = [r["url"] for r in replicas if r["weight_mode"] != mode]
        if wrong:
            raise PushError(f"replicas {wrong} were not started for {mode!r} weight updates "
                            f"(their modes: {sorted({r['weight_mode'] for r in replicas})}); refusing to push")
        return replicas

    def active_policy(self) -> dict[str, Any]:
        policy: dict[str, Any] = self._admin("GET", "/policy")
        return policy

    def _drain(self, url: str, reason: str) -> None:
        logger.error("replica %s failed the weight push (%s); draining it", url, reason)
        try:
            self._admin("POST", "/replicas/drain", json={"url": url})
        except PushError as exc:
            logger.error("could not drain %s: %s", url, exc)

    # -- LoRA ----------------------------------------------------------------------------

    def push_lora(self, version: int, adapter_dir: Path, *, base_model: str | None = None) -> PushResult:
        name = lora_name(version)
        result = PushResult(version, name, "lora")
        started = time.perf_counter()
        replicas = self.replicas("lora")
        if self._lora_transport == "bytes":
            # Before any replica is asked: a refused upload fails the push with every replica untouched.
            result.uploaded_bytes = self._upload(name, version, adapter_dir)
            action, body = "resolve_lora_adapter", {"lora_name": name}
        else:
            action, body = "load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)}
        for replica in replicas:
            url = replica["url"]
            try:
                self._control(url, action, body)
                self._unload_old(url, version)
            except (httpx.HTTPError, PushError) as exc:
                self._drain(url, str(exc))
                result.drained.append(url)
                continue
            result.pushed.append(url)
        if not result.pushed:
            raise PushError(f"no replica loaded adapter {name}")
        self._admin("PUT", "/policy", json={"version": version, "served_name": name, "kind": "lora",
                                            "base_model": base_model, "path": str(adapter_dir)})
        result.seconds = time.perf_counter() - started
        return result

    def _upload(self, name: str, version: int, adapter_dir: Path) -> int:
        """The adapter's folder to the proxy's database, once for every replica; returns its size."""
        archive = adapter_archive(adapter_dir)
        self._admin("PUT", f"/adapters/{name}", content=_pieces(archive),
                    params={"version": version, "keep": self._keep_loaded},
                    headers={**self._headers, "content-type": "application/octet-stream",
                             "content-length": str(len(archive)),
                             "x-rolltap-sha256": hashlib.sha256(archive).hexdigest()})
        return len(archive)

    def _unload_old(self, url: str, version: int) -> None:
        # Versions older than the last `keep_loaded` are done: their calls have long ended.
        stale = version - self._keep_loaded
        if stale < 1:
            return
        try:
            self._control(url, "unload_lora_adapter", {"lora_name": lora_name(stale)})
        except PushError as exc:  # already gone (404) or refused: the version is unused either way
            logger.warning("replica %s: unloading %s: %s", url, lora_name(stale), exc)

    # -- full weights --------------------------------------------------------------------

    def push_full(self, version: int, weights_dir: Path, *, served_name: str) -> PushResult:
        """Reload full weights from `weights_dir` on every replica; `served_name` is unchanged."""
        def reload(url: str) -> None:
            self._control(url, "collective_rpc", {"method": "reload_weights",
                                                  "kwargs": {"weights_path": str(weights_dir)}})

        return self._swap_full(version, served_name, str(weights_dir), reload)

    def push_full_in_memory(self, version: int, *, served_name: str, stage: Callable[[], dict[str, Any]],
                            release: Callable[[], None], path: str | None = None) -> PushResult:
        """Full weights through vLLM's weight-transfer engine (trainer/transfer.py): `stage()` gives the
        `update_info` every replica loads, `release()` frees it once they all have; no folder is written.

        Every replica is asked to set up its engine before anything is paused, so replicas started without
        `--weight-transfer-config` fail the push with every replica still serving the old policy."""
        for replica in self.replicas("full"):
            try:
                self._control(replica["url"], "init_weight_transfer_engine", {"init_info": {}})
            except PushError as exc:
                raise PushError(f"replica {replica['url']} takes no in-memory weights (started without "
                                f"--weight-transfer-config?): {exc}") from exc
        started = time.perf_counter()
        info = stage()  # before the pause: calls go on, on the old policy, while the weights are gathered
        staged_s = time.perf_counter() - started

        def load(url: str) -> None:
            self._control(url, "start_weight_update", None)
            self._control(url, "update_weights", {"update_info": info})
            self._control(url, "finish_weight_update", None)

        try:
            result = self._swap_full(version, served_name, path, load)
        finally:
            release()
        result.staged_s = staged_s
        result.seconds = time.perf_counter() - started
        return result

    def _swap_full(self, version: int, served_name: str, path: str | None, load: Callable[[str], None]) -> PushResult:
        """With admission paused and calls in flight ended: per replica pause, `load`, reset its prefix cache
        (cached blocks were computed by the old weights), resume; then make the version active."""
        replicas = self.replicas("full")
        result = PushResult(version, served_name, "full")
        started = time.perf_counter()
        self._admin("POST", "/pause", json={"wait": True})
        try:
            for replica in replicas:
                url = replica["url"]
                try:
                    self._control(url, "pause", None, {"mode": "wait"})
                    load(url)
                    self._control(url, "reset_prefix_cache", None)
                    self._control(url, "resume", None)
                except (httpx.HTTPError, PushError) as exc:
                    self._drain(url, str(exc))
                    result.drained.append(url)
                    continue
                result.pushed.append(url)
            if not result.pushed:
                raise PushError("no replica took the new weights")
            self._admin("PUT", "/policy", json={"version": version, "served_name": served_name, "kind": "full",
                                                "base_model": served_name, "path": path})
        finally:
            self._admin("POST", "/resume")
        result.seconds = time.perf_counter() - started
        return result

    def _control(self, url: str, action: str, body: dict[str, Any] | None,
                 params: dict[str, str] | None = None) -> None:
        """One of the replica's control routes, through the proxy's admin API (PushError when refused)."""
        self._admin("POST", "/replicas/control", json={"url": url, "action": action, "body": body, "params": params})


# httpx (httpcore 1.0) sends a body given as bytes by slicing off what each socket send took,
# copying the rest every time: quadratic in the size. A 335 MB adapter took 11-13 s to reach a
# proxy on the same host that way; given in pieces (with the length, so not chunked), the body
# arrives in 0.6-0.9 s.
_PIECE_BYTES = 1 << 20


def _pieces(data: bytes) -> Iterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), _PIECE_BYTES):
        yield bytes(view[start:start + _PIECE_BYTES])


def adapter_archive(adapter_dir: Path) -> bytes:
    """The adapter's folder as an uncompressed tar (safetensors do not compress), with its files at the
    top; the same folder gives the same bytes (sorted, times and owners zeroed), so one digest."""
    if not (adapter_dir / "adapter_config.json").is_file():
        raise PushError(f"{adapter_dir} is not a LoRA adapter folder (no adapter_config.json)")

    def plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        return info

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(adapter_dir.iterdir()):
            tar.add(path, arcname=path.name, filter=plain)
    return buffer.getvalue()
