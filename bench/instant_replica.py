"""Instant replica: a canned-response imitation of a vLLM OpenAI-compatible server.

This module owns a deliberately tiny HTTP/1.1 server that answers the handful of
routes the Rolltap proxy talks to on a vLLM replica (``/health``, ``/v1/models``,
``/metrics``, ``/v1/chat/completions``, ``/v1/completions``) with pre-rendered
bodies shaped like vLLM's output under ``return_token_ids: true`` + logprobs.
Its only job is to cost (almost) nothing per request, so that in a benchmark of
"client -> proxy -> replica" the proxy's own cost dominates.

Two interchangeable implementations live here:

* ``protocol`` (default): a bare ``asyncio.Protocol`` server on uvloop with a
  hand-written HTTP/1.1 request parser (keep-alive, pipelining, Content-Length
  and chunked request bodies, ``Expect: 100-continue``). Responses are cached
  as complete wire bytes (status line + headers + body), so serving a request
  is: find the header end, three regex scans of the body, one dict lookup, one
  ``bytes.replace`` for a fresh response id, one ``transport.write``.
* ``asgi``: the same canned responses from a raw ASGI callable under uvicorn
  (uvloop + httptools). Kept as the reference it was measured against; see
  ``docs/benchmarks.md`` -- the protocol server is several times cheaper.

Public API:

* ``start_instant_replica(port=0, ...) -> (url, stop)``: run a replica in a
  child process (so it gets its own core and its own GIL) and return its base
  URL and an idempotent stop callable.
* ``python -m bench.instant_replica --host H --port P --model-name NAME
  [--delay-ms MS] [--token-delay-ms MS] [--split-stream] [--impl protocol|asgi]``

Request parsing is intentionally minimal: the JSON body is never decoded, only
scanned for ``"stream": true``, ``"max_tokens"``/``"max_completion_tokens"``
and ``"include_usage": true``. The number of completion tokens equals
``max_tokens`` (default 16) and every response finishes with
``finish_reason: "length"``. The prompt token ids are a fixed list; the
replica does not tokenize anything.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Final, Literal, cast

import orjson

from bench.harness import REPO_ROOT, listen, stop_process, wait_ready

Impl = Literal["protocol", "asgi"]

DEFAULT_MODEL_NAME: Final = "tiny"
DEFAULT_MAX_TOKENS: Final = 16
# Caps what one request can make us pre-render and cache; max_tokens above it
# is clamped (a real server would reject it against max_model_len instead).
MAX_TOKENS_CAP: Final = 8192
MAX_MODEL_LEN: Final = 512
# Guard against a client that never finishes its headers.
_MAX_HEADER_BYTES: Final = 64 * 1024

# The canned "prompt": fixed so responses can be cached independent of the body.
PROMPT_TOKEN_IDS: Final[tuple[int, ...]] = (151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198)

# A cycle of (text, token id) pairs for generated tokens. One multi-byte token
# keeps consumers honest about `bytes` vs. `len(str)`.
_VOCAB: Final[tuple[tuple[str, int], ...]] = (
    (" The", 576),
    (" quick", 3974),
    (" brown", 13876),
    (" fox", 38835),
    (" jumps", 34208),
    (" over", 916),
    (" the", 279),
    (" lazy", 15678),
    (" dog", 5562),
    (" at", 518),
    (" the", 279),
    (" café", 53050),
    (".", 13),
    ("\n", 198),
)

# Responses are rendered once with this 32-byte placeholder where the id's
# random part goes, then each request swaps in a fresh value of equal length
# (so Content-Length and chunk sizes in the cached wire bytes stay valid).
_ID_PLACEHOLDER: Final = b"RTAPIDXXXXXXXXXXXXXXXXXXXXXXXXXX"
assert len(_ID_PLACEHOLDER) == 32
_ID_PREFIX: Final = os.urandom(4).hex().encode()
_id_counter = itertools.count(1)


def _next_id() -> bytes:
    # 8 hex chars of per-process randomness + 24 hex chars of counter: unique,
    # uuid4().hex-sized, and far cheaper than uuid4() per request.
    return _ID_PREFIX + b"%024x" % next(_id_counter)


_STREAM_RE: Final = re.compile(rb'"stream"\s*:\s*true')
_MAX_TOKENS_RE: Final = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')
_INCLUDE_USAGE_RE: Final = re.compile(rb'"include_usage"\s*:\s*true')
_LOGPROBS_RE: Final = re.compile(rb'"logprobs"\s*:\s*true')
_CONTENT_LENGTH_RE: Final = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)")
_CONNECTION_RE: Final = re.compile(rb"\r\nconnection:([^\r\n]*)")

_REASONS: Final = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}


def _logprob(i: int) -> float:
    # Deterministic, varied, always negative.
    return -round(0.0123 * ((i * 7) % 11) + 0.0011 * (i % 13) + 0.0005, 6)


def _token(i: int) -> tuple[str, int]:
    return _VOCAB[i % len(_VOCAB)]


class Prepared:
    """One canned response, kept both as ASGI parts and as complete wire bytes."""

    __slots__ = ("content_type", "cuts", "cuts_close", "has_id", "parts", "status", "streamed", "wire", "wire_close")

    def __init__(self, status: int, content_type: bytes, parts: Iterable[bytes], *, streamed: bool) -> None:
        self.status = status
        self.content_type = content_type
        self.parts: tuple[bytes, ...] = tuple(parts)
        self.streamed = streamed
        self.has_id = any(_ID_PLACEHOLDER in p for p in self.parts)
        self.wire, self.cuts = self._render_wire(keep_alive=True)
        self.wire_close, self.cuts_close = self._render_wire(keep_alive=False)

    def _render_wire(self, *, keep_alive: bool) -> tuple[bytes, tuple[int, ...]]:
        """Status line + headers + framed body, and the offsets where each SSE event ends.

        Streams use chunked transfer encoding with one HTTP chunk per SSE event,
        like uvicorn's StreamingResponse in front of vLLM, so clients exercise
        the same de-chunking path they would against a real replica.
        """
        head = [b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n" % (self.status, _REASONS[self.status], self.content_type)]
        if self.streamed:
            head.append(b"transfer-encoding: chunked\r\n")
        else:
            head.append(b"content-length: %d\r\n" % sum(len(p) for p in self.parts))
        if not keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        wire = b"".join(head)
        if not self.streamed:
            wire += b"".join(self.parts)
            return wire, (len(wire),)
        cuts = []
        for part in self.parts:
            wire += b"%x\r\n%s\r\n" % (len(part), part)
            cuts.append(len(wire))
        wire += b"0\r\n\r\n"
        cuts[-1] = len(wire)  # the terminating chunk travels with the last event
        return wire, tuple(cuts)


def _json(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_SSE_DONE: Final = b"data: [DONE]\n\n"
_JSON: Final = b"application/json"
_SSE_CT: Final = b"text/event-stream; charset=utf-8"


class Replica:
    """Route table + response cache. Shared by both server implementations."""

    def __init__(self, model_name: str = DEFAULT_MODEL_NAME) -> None:
        self.model_name = model_name
        self.created = int(time.time())
        self._cache: dict[tuple[bool, bool, int, bool, bool], Prepared] = {}
        self._health = Prepared(200, _JSON, [b""], streamed=False)
        self._models = Prepared(200, _JSON, [_json(self._models_body())], streamed=False)
        self._metrics = Prepared(
            200, b"text/plain; version=0.0.4; charset=utf-8", [self._metrics_body()], streamed=False
        )
        self._not_found = Prepared(404, _JSON, [b'{"detail":"Not Found"}'], streamed=False)
        self._not_allowed = Prepared(405, _JSON, [b'{"detail":"Method Not Allowed"}'], streamed=False)
        self._get_routes = {b"/health": self._health, b"/v1/models": self._models, b"/metrics": self._metrics}
        self._post_routes = {b"/v1/chat/completions": True, b"/v1/completions": False}

    # -- dispatch ---------------------------------------------------------

    def dispatch(self, method: bytes, target: bytes, body: bytes) -> Prepared:
        q = target.find(b"?")
        path = target if q < 0 else target[:q]
        if method == b"POST":
            is_chat = self._post_routes.get(path)
            if is_chat is None:
                return self._not_allowed if path in self._get_routes else self._not_found
            stream = _STREAM_RE.search(body) is not None
            m = _MAX_TOKENS_RE.search(body)
            n = min(max(int(m.group(1)), 1), MAX_TOKENS_CAP) if m else DEFAULT_MAX_TOKENS
            usage = stream and _INCLUDE_USAGE_RE.search(body) is not None
            # Streamed chat chunks carry logprobs only when asked, as vLLM's do (what
            # `proxy.rollout_logprobs` changes); the other shapes always have them.
            logprobs = not (is_chat and stream) or _LOGPROBS_RE.search(body) is not None
            key = (is_chat, stream, n, usage, logprobs)
            prepared = self._cache.get(key)
            if prepared is None:
                prepared = self._cache[key] = self._render(is_chat, stream, n, usage, logprobs)
            return prepared
        if method == b"GET" or method == b"HEAD":
            prepared = self._get_routes.get(path)
            if prepared is not None:
                return prepared
            return self._not_allowed if path in self._post_routes else self._not_found
        return self._not_allowed if path in self._get_routes or path in self._post_routes else self._not_found

    # -- static bodies ----------------------------------------------------

    def _models_body(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.model_name,
            "parent": None,
            "max_model_len": MAX_MODEL_LEN,
        }
        return {"object": "list", "data": [card]}

    def _metrics_body(self) -> bytes:
        label = f'{{model_name="{self.model_name}"}}'
        lines = []
        for name, help_text in (
            ("vllm:num_requests_running", "Number of requests in model execution batches."),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{label} 0.0"]
        return ("\n".join(lines) + "\n").encode()

    # -- completions ------------------------------------------------------

    def _usage(self, n: int) -> dict[str, Any]:
        p = len(PROMPT_TOKEN_IDS)
        return {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n, "prompt_tokens_details": None}

    def _render(self, is_chat: bool, stream: bool, n: int, usage: bool, logprobs: bool) -> Prepared:
        if is_chat:
            return self._render_chat_stream(n, usage, logprobs) if stream else self._render_chat(n)
        return self._render_completion_stream(n, usage) if stream else self._render_completion(n)

    def _head(self, is_chat: bool, chunk: bool) -> dict[str, Any]:
        rid = ("chatcmpl-" if is_chat else "cmpl-") + _ID_PLACEHOLDER.decode()
        if is_chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": self.created, "model": self.model_name}

    @staticmethod
    def _chat_logprob(i: int) -> dict[str, Any]:
        text, _ = _token(i)
        return {"token": text, "logprob": _logprob(i), "bytes": list(text.encode()), "top_logprobs": []}

    def _render_chat(self, n: int) -> Prepared:
        toks = [_token(i) for i in range(n)]
        body = self._head(True, False) | {
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "".join(t for t, _ in toks),
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": {"content": [self._chat_logprob(i) for i in range(n)]},
                    "finish_reason": "length",
                    "stop_reason": None,
                    "token_ids": [tid for _, tid in toks],
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self._usage(n),
            "prompt_logprobs": None,
            "prompt_token_ids": list(PROMPT_TOKEN_IDS),
            "kv_transfer_params": None,
        }
        return Prepared(200, _JSON, [_json(body)], streamed=False)

    def _render_chat_stream(self, n: int, usage: bool, logprobs: bool) -> Prepared:
        head = self._head(True, True)
        events = [
            _sse(
                head
                | {
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": list(PROMPT_TOKEN_IDS),
                }
            )
        ]
        for i in range(n):
            text, tid = _token(i)
            last = i == n - 1
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": {"content": [self._chat_logprob(i)]} if logprobs else None,
                "finish_reason": "length" if last else None,
                "token_ids": [tid],
            }
            if last:
                choice["stop_reason"] = None
            events.append(_sse(head | {"choices": [choice]}))
        if usage:
            events.append(_sse(head | {"choices": [], "usage": self._usage(n)}))
        events.append(_SSE_DONE)
        return Prepared(200, _SSE_CT, events, streamed=True)

    def _render_completion(self, n: int) -> Prepared:
        toks = [_token(i) for i in range(n)]
        offsets, off = [], 0
        for text, _ in toks:
            offsets.append(off)
            off += len(text)
        body = self._head(False, False) | {
            "choices": [
                {
                    "index": 0,
                    "text": "".join(t for t, _ in toks),
                    "logprobs": {
                        "text_offset": offsets,
                        "token_logprobs": [_logprob(i) for i in range(n)],
                        "tokens": [t for t, _ in toks],
                        "top_logprobs": [{t: _logprob(i)} for i, (t, _) in enumerate(toks)],
                    },
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": list(PROMPT_TOKEN_IDS),
                    "token_ids": [tid for _, tid in toks],
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self._usage(n),
            "kv_transfer_params": None,
        }
        return Prepared(200, _JSON, [_json(body)], streamed=False)

    def _render_completion_stream(self, n: int, usage: bool) -> Prepared:
        head = self._head(False, True)
        events, off = [], 0
        for i in range(n):
            text, tid = _token(i)
            last = i == n - 1
            choice: dict[str, Any] = {
                "index": 0,
                "text": text,
                "logprobs": {
                    "text_offset": [off],
                    "token_logprobs": [_logprob(i)],
                    "tokens": [text],
                    "top_logprobs": [{text: _logprob(i)}],
                },
                "finish_reason": "length" if last else None,
                "stop_reason": None,
            }
            if i == 0:
                # vLLM sends the prompt ids once, on the first chunk of each choice.
                choice["prompt_token_ids"] = list(PROMPT_TOKEN_IDS)
            choice["token_ids"] = [tid]
            off += len(text)
            events.append(_sse(head | {"choices": [choice]}))
        if usage:
            events.append(_sse(head | {"choices": [], "usage": self._usage(n)}))
        events.append(_SSE_DONE)
        return Prepared(200, _SSE_CT, events, streamed=True)


# ---------------------------------------------------------------------------
# Implementation 1: bare asyncio.Protocol HTTP/1.1 server
# ---------------------------------------------------------------------------


class _Options:
    __slots__ = ("delay_s", "split_stream", "token_delay_s")

    def __init__(self, delay_ms: float, token_delay_ms: float, split_stream: bool) -> None:
        self.delay_s = delay_ms / 1000.0
        self.token_delay_s = token_delay_ms / 1000.0
        # A per-token delay only means anything if events are written one by one.
        self.split_stream = split_stream or token_delay_ms > 0


def _dechunk(data: bytes, pos: int) -> tuple[bytes, int] | None:
    """Decode a chunked request body starting at ``pos``; None if incomplete."""
    out: list[bytes] = []
    n = len(data)
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(data[pos:eol].split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            # Skip (rare) trailers up to the blank line.
            end = data.find(b"\r\n", pos)
            while end > pos:
                pos = end + 2
                end = data.find(b"\r\n", pos)
            if end < 0:
                return None
            return b"".join(out), end + 2
        if pos + size + 2 > n:
            return None
        out.append(data[pos : pos + size])
        pos += size + 2


class _HttpProtocol(asyncio.Protocol):
    """One connection. Synchronous fast path; a task only when a delay is configured."""

    __slots__ = ("_buf", "_busy", "_opts", "_replica", "_sent_continue", "_t", "_task")

    def __init__(self, replica: Replica, opts: _Options) -> None:
        self._replica = replica
        self._opts = opts
        self._t: asyncio.Transport | None = None
        self._buf = b""
        self._busy = False  # a delayed response is in flight; queue pipelined input
        self._sent_continue = False
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self._t = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._t = None
        if self._task is not None:
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        if self._buf:
            data = self._buf + data
            self._buf = b""
        if self._busy:
            self._buf = data
            return
        self._process(data)

    def _error(self, status: int) -> None:
        t = self._t
        if t is not None:
            body = b'{"detail":"%s"}' % _REASONS[status]
            t.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                % (status, _REASONS[status], len(body), body)
            )
            t.close()

    def _process(self, data: bytes) -> None:
        t = self._t
        pos, n = 0, len(data)
        while pos < n and t is not None:
            hend = data.find(b"\r\n\r\n", pos)
            if hend < 0:
                if n - pos > _MAX_HEADER_BYTES:
                    self._error(400)
                    return
                break
            line_end = data.find(b"\r\n", pos, hend)
            if line_end < 0:
                line_end = hend
            parts = data[pos:line_end].split(b" ")
            if len(parts) != 3:
                self._error(400)
                return
            method, target, version = parts
            # Lowercased header block starting with "\r\n", so every header is
            # matched as "\r\nname:" without per-line splitting.
            hdrs = data[line_end:hend].lower()
            keep_alive = version == b"HTTP/1.1"
            if b"\r\nconnection:" in hdrs:
                m = _CONNECTION_RE.search(hdrs)
                if m is not None:
                    if b"close" in m.group(1):
                        keep_alive = False
                    elif b"keep-alive" in m.group(1):
                        keep_alive = True
            body_start = hend + 4
            if b"\r\ntransfer-encoding:" in hdrs and b"chunked" in hdrs:
                try:
                    res = _dechunk(data, body_start)
                except ValueError:
                    self._error(400)
                    return
                if res is None:
                    self._maybe_continue(hdrs)
                    break
                body, end = res
            else:
                m = _CONTENT_LENGTH_RE.search(hdrs)
                end = body_start + (int(m.group(1)) if m is not None else 0)
                if end > n:
                    self._maybe_continue(hdrs)
                    break
                body = data[body_start:end]
            self._sent_continue = False
            pos = end
            prepared = self._replica.dispatch(method, target, body)
            opts = self._opts
            if opts.delay_s > 0 or (prepared.streamed and opts.token_delay_s > 0):
                self._busy = True
                self._buf = data[pos:]
                self._task = asyncio.get_running_loop().create_task(
                    self._respond_later(prepared, keep_alive, method == b"HEAD")
                )
                return
            if method == b"HEAD":
                self._write_head_only(prepared, keep_alive)
            else:
                self._write_now(prepared, keep_alive)
            if not keep_alive:
                t.close()
                return
        self._buf = data[pos:] if pos < n else b""

    def _maybe_continue(self, hdrs: bytes) -> None:
        # curl (and others) wait ~1 s for this before sending bodies > 1 KiB.
        if not self._sent_continue and b"\r\nexpect: 100-continue" in hdrs and self._t is not None:
            self._t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._sent_continue = True

    def _write_now(self, prepared: Prepared, keep_alive: bool) -> None:
        assert self._t is not None
        wire = prepared.wire if keep_alive else prepared.wire_close
        if prepared.has_id:
            wire = wire.replace(_ID_PLACEHOLDER, _next_id())
        if prepared.streamed and self._opts.split_stream:
            # One write (one send(2), TCP_NODELAY) per SSE event, so the client
            # sees events arrive separately as from a real replica, without the
            # cost of a loop iteration per event.
            start = 0
            for cut in prepared.cuts if keep_alive else prepared.cuts_close:
                self._t.write(wire[start:cut])
                start = cut
        else:
            self._t.write(wire)

    def _write_head_only(self, prepared: Prepared, keep_alive: bool) -> None:
        wire = prepared.wire if keep_alive else prepared.wire_close
        assert self._t is not None
        self._t.write(wire[: wire.find(b"\r\n\r\n") + 4])

    async def _respond_later(self, prepared: Prepared, keep_alive: bool, head_only: bool) -> None:
        opts = self._opts
        if opts.delay_s > 0:
            await asyncio.sleep(opts.delay_s)
        if self._t is None:
            return
        if head_only:
            self._write_head_only(prepared, keep_alive)
        elif prepared.streamed and opts.token_delay_s > 0:
            # Paced stream: one write per SSE event with the delay in between.
            wire = prepared.wire if keep_alive else prepared.wire_close
            if prepared.has_id:
                wire = wire.replace(_ID_PLACEHOLDER, _next_id())
            start = 0
            for cut in prepared.cuts if keep_alive else prepared.cuts_close:
                if start:
                    await asyncio.sleep(opts.token_delay_s)
                    if self._t is None:
                        return
                self._t.write(wire[start:cut])
                start = cut
        else:
            self._write_now(prepared, keep_alive)
        if not keep_alive:
            self._t.close()
            return
        self._busy = False
        self._task = None
        if self._buf:
            data, self._buf = self._buf, b""
            self._process(data)


async def _serve_protocol(sock: socket.socket, replica: Replica, opts: _Options) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _HttpProtocol(replica, opts), sock=sock, backlog=2048)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


# ---------------------------------------------------------------------------
# Implementation 2: raw ASGI app (for comparison; runs under uvicorn)
# ---------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def make_asgi_app(replica: Replica, opts: _Options) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while True:
                    msg = await receive()
                    if msg["type"] == "lifespan.startup":
                        await send({"type": "lifespan.startup.complete"})
                    elif msg["type"] == "lifespan.shutdown":
                        await send({"type": "lifespan.shutdown.complete"})
                        return
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        prepared = replica.dispatch(scope["method"].encode(), scope["path"].encode(), body)
        if opts.delay_s > 0:
            await asyncio.sleep(opts.delay_s)
        parts = prepared.parts
        if prepared.has_id:
            new_id = _next_id()
            parts = tuple(p.replace(_ID_PLACEHOLDER, new_id) for p in parts)
        headers = [(b"content-type", prepared.content_type)]
        if not prepared.streamed:
            headers.append((b"content-length", b"%d" % len(parts[0])))
        await send({"type": "http.response.start", "status": prepared.status, "headers": headers})
        if not prepared.streamed:
            await send({"type": "http.response.body", "body": parts[0]})
            return
        if opts.split_stream:
            for i, part in enumerate(parts):
                if i and opts.token_delay_s > 0:
                    await asyncio.sleep(opts.token_delay_s)
                await send({"type": "http.response.body", "body": part, "more_body": True})
        else:
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def _serve_asgi(sock: socket.socket, replica: Replica, opts: _Options) -> None:
    import uvicorn  # only needed for the comparison implementation

    config = uvicorn.Config(
        make_asgi_app(replica, opts),
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        server_header=False,
        date_header=False,
    )
    uvicorn.Server(config).run(sockets=[sock])


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def exit_with_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """SIGTERM this process once ``parent_pid`` is gone (polled from a daemon thread).

    Children started by ``start_instant_replica`` (and the benchmark's
    forwarders) use this so a test or benchmark that dies without calling
    ``stop()`` -- SIGKILL, a SIGPIPE'd script -- does not leave servers behind.
    Polling rather than PR_SET_PDEATHSIG: that fires when the *thread* that
    spawned us exits, which would kill a replica started from a worker thread.
    """
    import threading

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    if os.getppid() != parent_pid:  # parent died before we got here
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    sock: socket.socket,
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    delay_ms: float = 0.0,
    token_delay_ms: float = 0.0,
    split_stream: bool = False,
    impl: Impl = "protocol",
) -> None:
    """Serve on an already-listening socket until SIGINT/SIGTERM (blocks)."""
    replica = Replica(model_name)
    opts = _Options(delay_ms, token_delay_ms, split_stream)
    if impl == "asgi":
        _serve_asgi(sock, replica, opts)
        return
    try:
        import uvloop
    except ImportError:  # plain asyncio still works, just slower
        asyncio.run(_serve_protocol(sock, replica, opts))
    else:
        uvloop.run(_serve_protocol(sock, replica, opts))


def start_instant_replica(
    port: int = 0,
    *,
    host: str = "127.0.0.1",
    model_name: str = DEFAULT_MODEL_NAME,
    delay_ms: float = 0.0,
    token_delay_ms: float = 0.0,
    split_stream: bool = False,
    impl: Impl = "protocol",
    cpus: set[int] | None = None,
    startup_timeout: float = 10.0,
) -> tuple[str, Callable[[], None]]:
    """Start an instant replica in a child process; return ``(base_url, stop)``.

    The parent binds and listens (so ``port=0`` needs no port-discovery
    handshake and there is no bind race), hands the socket to the child via fd
    inheritance, then closes its own copy so a dead child means "connection
    refused" instead of a hang. ``stop()`` is idempotent: SIGTERM, then SIGKILL
    after 5 s. ``cpus`` pins the child (``os.sched_setaffinity``).
    """
    sock = listen(host, port)
    actual_port = sock.getsockname()[1]
    fd = sock.fileno()
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--fd",
        str(fd),
        "--parent-pid",
        str(os.getpid()),
        "--model-name",
        model_name,
        "--delay-ms",
        str(delay_ms),
        "--token-delay-ms",
        str(token_delay_ms),
        "--impl",
        impl,
    ]
    if split_stream:
        cmd.append("--split-stream")
    try:
        # The child runs this file as a script (its command line names it: bench.proxy_overhead
        # finds it so); the repository root on its path lets it import `bench.harness`.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL, env=env)
    finally:
        sock.close()
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)

    def stop() -> None:
        stop_process(proc)

    url = _url(host, actual_port)
    try:
        wait_ready(url, "/health", proc, startup_timeout, poll_s=0.02)
    except BaseException:
        stop()
        raise
    return url, stop


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.instant_replica", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on stderr)")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    p.add_argument("--delay-ms", type=float, default=0.0, help="sleep before answering each request")
    p.add_argument(
        "--token-delay-ms",
        type=float,
        default=0.0,
        help="sleep between SSE events of a streamed response (implies --split-stream)",
    )
    p.add_argument(
        "--split-stream",
        action="store_true",
        help="write each SSE event separately (default: the whole stream in one write)",
    )
    p.add_argument("--impl", choices=("protocol", "asgi"), default="protocol")
    # Used by start_instant_replica: inherited listening socket, and who to outlive no longer than.
    p.add_argument("--fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    if args.fd is not None:
        sock = socket.socket(fileno=args.fd)  # family/type auto-detected from the fd
    else:
        sock = listen(args.host, args.port)
        print(f"instant replica ({args.impl}) listening on {_url(args.host, sock.getsockname()[1])}", file=sys.stderr)
    serve(
        sock,
        model_name=args.model_name,
        delay_ms=args.delay_ms,
        token_delay_ms=args.token_delay_ms,
        split_stream=args.split_stream,
        impl=args.impl,
    )


if __name__ == "__main__":
    main()
