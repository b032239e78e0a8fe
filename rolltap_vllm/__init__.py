"""A vLLM plugin: LoRA adapters by name from a Rolltap proxy, for replicas that share no filesystem
with the trainer (`trainer.lora_transport = "bytes"`).

vLLM asks its LoRA resolvers about a model it does not serve yet when an inference call names it
(with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`); `/v1/load_lora_adapter` never asks them. This resolver
fetches `GET $ROLLTAP_LORA_SOURCE/adapters/<name>` with `Authorization: Bearer $ROLLTAP_LORA_TOKEN`,
checks the bytes against the SHA-256 the proxy stored with them, unpacks the tar into
`$ROLLTAP_LORA_CACHE_DIR/<sha256>/` and hands vLLM that folder. The trainer's push triggers it
through the proxy (`POST /admin/replicas/control`, action `resolve_lora_adapter`); a replica
restarted or added later fetches the active adapter on its first call the same way. Unpacked
adapters the proxy no longer stores are deleted at the next fetch.

It also registers `rolltap_shm`, a weight-transfer backend for full weights through host shared memory
(rolltap_vllm/shm_engine.py; `trainer.weight_transfer = "shm"`), and sends sampled logprobs from the engine
core to the API servers as bytes instead of numpy arrays (rolltap_vllm/logprobs_wire.py: on for the vLLM
releases it was checked against unless `ROLLTAP_VLLM_LOGPROBS_WIRE=numpy`).

Standalone: the standard library and vLLM (with its numpy) only, never Rolltap's packages, since it is
installed into the replica's environment (`pip install ./rolltap_vllm`). The resolver is off unless
`ROLLTAP_LORA_SOURCE` is set. It never logs the token.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import logging
import os
import re
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from rolltap_vllm import logprobs_wire

__all__ = ["AdapterFetchError", "AdapterSource", "register"]

# Under "vllm.": vLLM's own logging configuration (handler, format, level) applies to these lines.
logger = logging.getLogger("vllm.rolltap_vllm")

ENV_SOURCE = "ROLLTAP_LORA_SOURCE"
ENV_TOKEN = "ROLLTAP_LORA_TOKEN"
ENV_CACHE_DIR = "ROLLTAP_LORA_CACHE_DIR"
ENV_TIMEOUT_S = "ROLLTAP_LORA_TIMEOUT_S"
# The proxy's header names (proxy/routes/adapters.py): the body's digest, and every digest it stores.
DIGEST_HEADER = "x-rolltap-sha256"
STORED_HEADER = "x-rolltap-adapters"
_DIGEST = re.compile(r"[0-9a-f]{64}")


class AdapterFetchError(RuntimeError):
    """The proxy refused the fetch, or the bytes did not check out."""


class AdapterSource:
    """Adapters of one proxy, unpacked under `cache_dir` (None: a private temporary folder)."""

    def __init__(self, url: str, token: str, cache_dir: Path | None = None, timeout_s: float = 300.0) -> None:
        self._url = url.rstrip("/")
        parts = urllib.parse.urlsplit(self._url)
        self._shown = f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")  # no userinfo
        self._token = token
        self._cache_dir = cache_dir
        self._timeout_s = timeout_s

    @property
    def cache_dir(self) -> Path:
        if self._cache_dir is None:  # made on first use: every vLLM process registers, few fetch
            self._cache_dir = Path(tempfile.mkdtemp(prefix="rolltap-lora-"))
        else:
            self._cache_dir.mkdir(parents=True, exist_ok=True)
        return self._cache_dir

    def fetch(self, name: str) -> Path | None:
        """The folder of adapter `name`, fetched and checked; None when the proxy stores none of that name."""
        request = urllib.request.Request(f"{self._url}/adapters/{urllib.parse.quote(name, safe='')}",
                                         headers={"authorization": f"Bearer {self._token}"})
        requested_at = time.time()
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                data: bytes = response.read()
                expected = (response.headers.get(DIGEST_HEADER) or "").strip().lower()
                stored = (response.headers.get(STORED_HEADER) or "").split(",")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                logger.info("rolltap: the proxy at %s stores no LoRA adapter %r", self._shown, name)
                return None
            detail = exc.read()[:300].decode("utf-8", "replace")
            raise AdapterFetchError(f"the proxy at {self._shown} answered {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise AdapterFetchError(f"the proxy at {self._shown} could not be reached: {exc}") from None
        actual = hashlib.sha256(data).hexdigest()
        if not _DIGEST.fullmatch(expected) or not hmac.compare_digest(actual, expected):
            raise AdapterFetchError(f"{len(data)} bytes with SHA-256 {actual}, not the {expected or 'missing'} "
                                    "the proxy stored: refused")
        folder = self._unpack(actual, data)
        self._prune({actual, *stored}, requested_at)
        return folder

    def _unpack(self, digest: str, data: bytes) -> Path:
        target = self.cache_dir / digest
        if target.is_dir():  # the same bytes, unpacked before (a folder appears whole: renamed into place)
            return target
        staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=self.cache_dir))
        try:
            try:
                with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
                    # "data": no absolute paths, no `..`, no links out of the folder, no devices.
                    tar.extractall(staging, filter="data")
            except (tarfile.TarError, OSError) as exc:
                raise AdapterFetchError(f"the adapter's archive does not unpack: {exc}") from None
            if not (staging / "adapter_config.json").is_file():
                raise AdapterFetchError("the adapter's archive has no adapter_config.json at its top")
            try:
                staging.rename(target)
            except OSError:
                if not target.is_dir():  # else another process unpacked the same bytes meanwhile
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def _prune(self, keep: set[str], requested_at: float) -> None:
        # The proxy keeps the last `trainer.keep_loaded_versions` (and the active one); the trainer
        # unloads older versions from vLLM, so their folders are read no more. Only folders older
        # than this fetch's request go: one a concurrent, later fetch unpacked may be newer than
        # the list this answer carried.
        for entry in self.cache_dir.iterdir():
            if not _DIGEST.fullmatch(entry.name) or entry.name in keep:
                continue
            try:
                is_older = entry.stat().st_mtime < requested_at
            except OSError:  # removed meanwhile by a concurrent prune
                continue
            if is_older:
                shutil.rmtree(entry, ignore_errors=True)


def _resolver(source: AdapterSource) -> Any:
    # vLLM is imported here, not at the top: the module's fetching is usable (and tested) without it.
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    class RolltapResolver(LoRAResolver):  # type: ignore[misc]  # vLLM is untyped where mypy runs
        async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
            try:
                # Off the event loop: the API server keeps serving while the bytes arrive.
                folder = await asyncio.to_thread(source.fetch, lora_name)
            except AdapterFetchError as exc:
                logger.error("rolltap: LoRA adapter %r not loaded: %s", lora_name, exc)
                return None
            if folder is None:
                return None
            # vLLM assigns the id (resolve_lora overwrites it); 1 passes LoRARequest's own check.
            return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=str(folder))

    return RolltapResolver()


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point, called in each of its processes: registers the weight-transfer
    backend `rolltap_shm` (rolltap_vllm/shm_engine.py, loaded only when a replica is started with it) and, when
    `ROLLTAP_LORA_SOURCE` is set, the resolver. A source without a token fails the start: every fetch would be
    refused. The logprob transport switches here too, in the engine core and in every API server alike."""
    _register_shm_engine()
    logprobs_wire.install()
    url = os.environ.get(ENV_SOURCE, "").strip()
    if not url:
        return
    token = os.environ.get(ENV_TOKEN, "").strip()
    if not token:
        raise RuntimeError(f"{ENV_SOURCE} is set but {ENV_TOKEN} is not: the proxy refuses adapter fetches "
                           "without its proxy.adapter_token")
    if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() not in ("1", "true"):
        logger.warning("rolltap: %s is set but VLLM_ALLOW_RUNTIME_LORA_UPDATING is not: vLLM will not ask "
                       "for adapters", ENV_SOURCE)
    cache = os.environ.get(ENV_CACHE_DIR, "").strip()
    source = AdapterSource(url, token, Path(cache) if cache else None,
                           float(os.environ.get(ENV_TIMEOUT_S) or 300.0))
    from vllm.lora.resolver import LoRAResolverRegistry

    LoRAResolverRegistry.register_resolver("rolltap", _resolver(source))


def _register_shm_engine() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight-transfer engines: nothing to add to
        return
    try:
        WeightTransferEngineFactory.register_engine("rolltap_shm", "rolltap_vllm.shm_engine", "ShmWeightTransferEngine")
    except ValueError:  # registered already: vLLM loads plugins once per process, but a host may call this again
        pass
