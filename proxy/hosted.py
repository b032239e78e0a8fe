"""Hosted models (OpenAI, Anthropic, Azure, any OpenAI-compatible server) through LiteLLM's Router.

Configured with a LiteLLM `model_list` (`proxy.litellm_config`, a YAML file). A call whose
`model` names one of them goes through the Router instead of a vLLM replica and is
recorded the same way, without token IDs where the provider gives none (the trainer
re-tokenises such records and flags them). litellm is imported only here, and only when
such models are configured: the import costs seconds and the proxy does not need it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import orjson
from starlette.responses import Response

from proxy.call import CallState
from shared.errors import InvalidRequest, NotFound, RolltapError, UpstreamTimeout, UpstreamUnavailable
from shared.types import CallStatus, Route

__all__ = ["HostedModels", "Relay", "load_hosted"]

logger = logging.getLogger(__name__)

_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.)*)"')


class Relay(Protocol):
    """What a hosted call uses of `proxy.relay.Relay` (which imports this module, not the reverse)."""

    def parse(self, call: CallState, raw: bytes, *, rewrite: bool) -> dict[str, Any]: ...

    def trace_headers(self, call: CallState) -> dict[str, str]: ...

    def keep(self, call: CallState, body: bytes) -> None: ...

    async def record(self, call: CallState) -> None: ...

    def stream_response(self, call: CallState, chunks: AsyncIterator[bytes], content_type: str, *,
                        close: Callable[[], None], on_source_error: Callable[[BaseException], dict[str, object]],
                        finish: Callable[[bytes, bool], Awaitable[None]]) -> Response: ...


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

    async def handle(self, relay: Relay, call: CallState, route: str, raw: bytes, model: str) -> Response:
        body = relay.parse(call, raw, rewrite=False)
        call.replica = f"litellm:{model}"
        kwargs = {k: v for k, v in body.items() if k not in ("stream_options", "return_token_ids")}
        if trace := relay.trace_headers(call):
            kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), **trace}
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
        call.t_first_byte = time.perf_counter()
        call.http_status = 200
        if not call.is_streaming:
            content = orjson.dumps(result.model_dump(exclude_none=True))
            relay.keep(call, content)  # the record's copy is cut at recorder.max_body_bytes; the client gets all
            return Response(content, media_type="application/json", headers=call.headers())

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in result:
                yield b"data: " + orjson.dumps(chunk.model_dump(exclude_none=True)) + b"\n\n"
            yield b"data: [DONE]\n\n"

        def on_error(exc: BaseException) -> dict[str, object]:
            error = _map_error(exc).body()["error"]
            call.fail(CallStatus.FAILED, error)
            return error  # type: ignore[return-value]

        async def finish(kept: bytes, truncated: bool) -> None:
            call.body, call.truncated = kept, truncated
            await relay.record(call)

        return relay.stream_response(call, chunks(), "text/event-stream", close=lambda: None,
                                     on_source_error=on_error, finish=finish)


def _map_error(exc: BaseException) -> RolltapError:
    name = exc.__class__.__name__
    status = getattr(exc, "status_code", None)
    message = f"hosted model error: {name}: {exc}"
    if "Timeout" in name:
        return UpstreamTimeout(message)
    if status is not None and 400 <= int(status) < 500:
        return InvalidRequest(message, code=name)
    return UpstreamUnavailable(message, code=name)
