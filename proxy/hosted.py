"""Hosted models (OpenAI, Anthropic, Azure, any OpenAI-compatible server) through LiteLLM's Router.

Configured with a LiteLLM `model_list` (`proxy.litellm_config`, a YAML file). A call whose
`model` names one of them goes through the Router instead of a vLLM replica and is
recorded the same way (`HostedModels.post` answers an `UpstreamResponse`, as a replica
does), without token IDs where the provider gives none (the trainer
re-tokenises such records and flags them). litellm is imported only here, and only when
such models are configured: the import costs seconds and the proxy does not need it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from proxy.upstream import UpstreamResponse
from shared.errors import InvalidRequest, NotFound, RolltapError, UpstreamTimeout, UpstreamUnavailable
from shared.types import Route

__all__ = ["HostedModels", "load_hosted"]

logger = logging.getLogger(__name__)

_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.)*)"')


def load_hosted(config_path: Path | None) -> HostedModels | None:
    if config_path is None:
        return None
    import yaml

    config = yaml.safe_load(config_path.read_text())
    model_list = config.get("model_list") if isinstance(config, dict) else None
    if not model_list:
        raise ValueError(f"{config_path}: no `model_list`")
    return HostedModels(model_list)


class HostedModels:
    def __init__(self, model_list: list[dict[str, Any]]) -> None:
        import litellm  # deferred: see module docstring
        from litellm.router import Router  # its home: litellm's __init__ imports it without re-exporting

        litellm.drop_params = True  # vLLM-only fields must not break other providers
        self._router = Router(model_list=model_list)
        self.names = frozenset(str(m["model_name"]) for m in model_list)
        logger.info("hosted models: %s", ", ".join(sorted(self.names)))

    def model_of(self, raw: bytes) -> str | None:
        """The body's `model` if it names a hosted model. A cheap scan: no full parse on the vLLM path."""
        match = _MODEL_FIELD.search(raw)
        if match is None:
            return None
        name = orjson.loads(b'"' + match.group(1) + b'"')
        return name if name in self.names else None

    async def post(self, model: str, route: str, body: dict[str, Any], trace_headers: dict[str, str]) -> UpstreamResponse:
        """Ask `model` through the Router; answers like a replica does (`proxy.upstream`), errors mapped here."""
        kwargs = {k: v for k, v in body.items() if k not in ("stream_options", "return_token_ids")}
        if trace_headers:
            kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), **trace_headers}
        try:
            if route == Route.CHAT:
                result = await self._router.acompletion(**kwargs)
            elif route == Route.COMPLETIONS:
                result = await self._router.atext_completion(**kwargs)
            else:
                raise NotFound(f"route {route} is not served for hosted model {model!r}", code="unsupported_route")
        except RolltapError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to our error tree here, once
            raise _map_error(exc) from exc
        return _HostedResponse(result, is_stream=bool(body.get("stream")))


class _HostedResponse(UpstreamResponse):
    """A LiteLLM result as a replica's answer: its JSON, or its chunks as server-sent events."""

    def __init__(self, result: Any, *, is_stream: bool) -> None:
        self._result = result
        self.status = 200
        self.content_type = "text/event-stream" if is_stream else "application/json"

    async def read(self) -> bytes:
        return orjson.dumps(self._result.model_dump(exclude_none=True))

    async def aiter(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._result:
                yield b"data: " + orjson.dumps(chunk.model_dump(exclude_none=True)) + b"\n\n"
        except Exception as exc:  # noqa: BLE001 - mapped to our error tree here, once
            raise _map_error(exc) from exc
        yield b"data: [DONE]\n\n"

    def release(self) -> None:
        pass  # the Router holds no connection of ours


def _map_error(exc: BaseException) -> RolltapError:
    name = exc.__class__.__name__
    status = getattr(exc, "status_code", None)
    message = f"hosted model error: {name}: {exc}"
    if "Timeout" in name:
        return UpstreamTimeout(message)
    if status is not None and 400 <= int(status) < 500:
        return InvalidRequest(message, code=name)
    return UpstreamUnavailable(message, code=name)
