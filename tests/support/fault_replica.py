"""A fault-injecting replica for what vLLM cannot be made to show on demand.

Raw ASGI, vLLM-shaped. A request's `"fault"` object (the proxy forwards it untouched)
picks the behaviour:
  {"status": 500}                      answer with that HTTP error (OpenAI shape)
  {"delay_s": 0.2}                     wait before each streamed chunk (before a whole answer)
  {"drop_after": 3}                    send 3 chunks, then cut the connection
  {"chunks": ["data: ...", ...]}      stream exactly these byte strings (odd boundaries welcome)
  {"sleep_s": 1.0}                     wait before a non-streamed answer
  {"pad_bytes": 1000000}               a non-streamed answer whose content is that many bytes long
  {"chunks_b64": ["...", ...]}         the same, as base64: any bytes, invalid UTF-8 included
  {"echo": true}                       answer with the last message's content as the completion,
                                       one chat chunk per character when streamed
  {"answer": {...}}                    answer (not streamed) with exactly this JSON: a model's output in
                                       a format the test spells out (tool calls with their token IDs)
  {"echo": true, "splits": [5, 9]}     ... and cut the stream's bytes at those offsets (a split may
                                       fall inside a multi-byte character)
Bodies are parsed as vLLM does (lone surrogate escapes allowed) and answered with escapes where
UTF-8 cannot carry a character.
`stats` counts requests and how many streams ended because the client went away, and
lists every path asked for other than the probes (`/health`, `/metrics`) and the model list.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, field
from typing import Any

import orjson

from shared.verbatim import dumps_exact, loads_exact

MODEL = "fault-model"


def chat_chunk(i: int, *, first: bool = False, last: bool = False) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": "length" if last else None,
                              "token_ids": [100 + i],
                              "logprobs": {"content": [{"token": f"t{i} ", "logprob": -0.5 - i / 100,
                                                        "bytes": [], "top_logprobs": []}]}}
    body: dict[str, Any] = {"id": "chatcmpl-fault", "object": "chat.completion.chunk", "created": 1,
                            "model": MODEL, "choices": [choice]}
    if first:
        body["prompt_token_ids"] = [1, 2, 3]
    return b"data: " + orjson.dumps(body) + b"\n\n"


@dataclass
class FaultStats:
    requests: int = 0
    disconnects: int = 0
    completed: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # each request's headers, lower-cased names
    paths: list[str] = field(default_factory=list)  # raw paths; probes and /v1/models left out


class FaultReplica:
    def __init__(self) -> None:
        self.stats = FaultStats()
        self.default_fault: dict[str, Any] = {}  # applied when a request names none

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/health":
            await self._json(send, 200, {})
            return
        if path == "/metrics":
            data = (f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
                    f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
                    f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n').encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": data})
            return
        if path == "/v1/models":
            await self._json(send, 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            return
        self.stats.paths.append(scope.get("raw_path", path.encode()).decode("latin-1"))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = loads_exact(body) if body else {}
        self.stats.requests += 1
        self.stats.bodies.append(request)
        self.stats.headers.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        fault = request.get("fault") or self.default_fault
        if "status" in fault:
            await self._json(send, fault["status"], {"error": {"message": "injected", "type": "injected",
                                                               "param": None, "code": fault["status"]}})
            return
        if fault.get("echo"):
            await self._echo(send, request, fault)
            return
        if "answer" in fault:
            await self._json(send, 200, fault["answer"])
            self.stats.completed += 1
            return
        if not request.get("stream"):
            if fault.get("delay_s"):
                gone = asyncio.ensure_future(receive())  # the body is read: the next message is a disconnect
                done, _ = await asyncio.wait([gone], timeout=fault["delay_s"])
                if done:
                    self.stats.disconnects += 1
                    return
                gone.cancel()
            if fault.get("sleep_s"):
                await asyncio.sleep(fault["sleep_s"])
            content = "x" * fault["pad_bytes"] if fault.get("pad_bytes") else "ok"
            await self._json(send, 200, {"id": "chatcmpl-fault", "object": "chat.completion", "model": MODEL,
                                         "prompt_token_ids": [1, 2, 3],
                                         "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                                      "finish_reason": "stop", "token_ids": [7],
                                                      "logprobs": {"content": [{"token": "ok", "logprob": -0.1}]}}]})
            return
        await self._stream(send, receive, request, fault)

    async def _stream(self, send: Any, receive: Any, request: dict[str, Any], fault: dict[str, Any]) -> None:
        n = int(request.get("max_tokens") or 8)
        if "chunks_b64" in fault:
            fault = {**fault, "chunks": [base64.b64decode(c) for c in fault["chunks_b64"]]}
        chunks: list[bytes] = [c if isinstance(c, bytes) else c.encode() for c in fault["chunks"]] if "chunks" in fault else [
            chat_chunk(i, first=i == 0, last=i == n - 1) for i in range(n)] + [b"data: [DONE]\n\n"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            for i, chunk in enumerate(chunks):
                if "drop_after" in fault and i == fault["drop_after"]:
                    raise ConnectionAbortedError("injected: connection cut mid-stream")
                if fault.get("delay_s"):
                    try:
                        await asyncio.wait_for(gone.wait(), fault["delay_s"])
                    except TimeoutError:
                        pass
                if gone.is_set():
                    self.stats.disconnects += 1
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.stats.completed += 1
        finally:
            watcher.cancel()

    async def _echo(self, send: Any, request: dict[str, Any], fault: dict[str, Any]) -> None:
        text = str((request.get("messages") or [{}])[-1].get("content") or "")
        if not request.get("stream"):
            await self._json(send, 200, {"id": "chatcmpl-echo", "object": "chat.completion", "model": MODEL,
                                         "prompt_token_ids": [1, 2, 3],
                                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                      "finish_reason": "stop", "token_ids": [7]}]})
            self.stats.completed += 1
            return
        events = [b"data: " + dumps_exact({
            "id": "chatcmpl-echo", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            **({"prompt_token_ids": [1, 2, 3]} if i == 0 else {}),
            "choices": [{"index": 0, "delta": {"content": ch}, "token_ids": [7],
                         "finish_reason": "stop" if i == len(text) - 1 else None}]}) + b"\n\n"
            for i, ch in enumerate(text)]
        stream = b"".join(events) + b"data: [DONE]\n\n"
        cuts = sorted({0, len(stream), *(c for c in fault.get("splits") or () if 0 < c < len(stream))})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for start, end in zip(cuts, cuts[1:], strict=False):
            await send({"type": "http.response.body", "body": stream[start:end], "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.stats.completed += 1

    @staticmethod
    async def _json(send: Any, status: int, body: Any) -> None:
        data = dumps_exact(body)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})
