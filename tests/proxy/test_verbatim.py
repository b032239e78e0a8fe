"""Anything a client or model can produce is recorded exactly, on SQLite and PostgreSQL alike.

U+0000 and other control characters (JSONB rejects U+0000), lone surrogates written as JSON
escapes (orjson refuses them; vLLM accepts them), non-BMP characters, numbers outside float64,
deep nesting, invalid UTF-8 and multi-byte characters split across stream chunks, large
bodies: GET attempt gives back the bytes the client sent and received, and the parsed request
and response exactly. Through the real proxy under uvicorn, with real HTTP clients; the
completions come from the fault replica echoing the prompt (vLLM cannot be made to emit a
given text), and once from the real vLLM replica.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.verbatim import MAX_DEPTH
from tests.conftest import DB_KINDS, make_settings
from tests.support.databases import database
from tests.support.servers import RunningProxy, run_proxy

_examples = itertools.count()
EXAMPLES = int(os.environ.get("ROLLTAP_TEST_VERBATIM_EXAMPLES", "1000"))


@pytest.fixture(scope="module", params=DB_KINDS)
def proxy(request: pytest.FixtureRequest, replica: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProxy]:
    """One proxy per database for every example (a proxy per example would cost seconds each)."""
    tmp = tmp_path_factory.mktemp(f"verbatim-{request.param}")
    # A 1 MiB body limit keeps the at-the-limit case quick; nothing else depends on it.
    with database(request.param, tmp) as url, \
            run_proxy(make_settings(url, [replica], tmp, recorder={"max_body_bytes": 1 << 20})) as running:
        yield running


def body_bytes(call: dict[str, Any], name: str) -> bytes:
    text, encoding = call[name], call[f"{name}_encoding"]
    return base64.b64decode(text) if encoding == "base64" else text.encode("utf-8")


def only_call(http: httpx.Client, proxy: RunningProxy, rollout: str) -> dict[str, Any]:
    got = http.get(f"{proxy.url}/rollout/{rollout}/attempt/0")
    assert got.status_code == 200, got.text
    attempt = json.loads(got.content)  # the stdlib reads lone surrogate escapes back as they were
    assert attempt["is_durable"] is True
    [call] = attempt["calls"]
    return call


# -- what a client can send -------------------------------------------------------------------

# Every code point, lone surrogates (category Cs) and U+0000 included.
any_text = st.text(st.characters(codec=None, categories=None), max_size=40)
hard_text = st.lists(st.sampled_from(["\x00", "\x01", "\x1f", "\x7f", "\ud800", "\udfff", "\ud83d", "😀", "𝄞",
                                      "\u2028", "\ufffd", "\\u0000", "é", "€", "\t", "\n"]), max_size=8).map("".join)
texts = st.one_of(any_text, hard_text, st.tuples(any_text, hard_text).map("".join))
# Number literals as a client writes them, those float64 cannot hold among them.
numbers = st.sampled_from(["0", "-0", "1e400", "-1e400", "1e-400", "123456789012345678901234567890",
                           "-98765432109876543210987654321", "0.1000000000000000055511151231257827",
                           "3.141592653589793238462643383279", "1E+2", "18446744073709551616"])


def _json_str(text: str, ascii_only: bool) -> str:
    if not ascii_only and not any("\ud800" <= c <= "\udfff" for c in text):
        return json.dumps(text, ensure_ascii=False)
    return json.dumps(text)  # lone surrogates can only travel as escapes


@st.composite
def request_bodies(draw: st.DrawFn) -> tuple[bytes, str, bool]:
    """A chat request as raw bytes (with literal numbers and nesting JSON libraries would not write)."""
    prompt = draw(texts)
    stream = draw(st.booleans())
    ascii_only = draw(st.booleans())
    depth = draw(st.integers(0, MAX_DEPTH - 3))  # orjson writes 255 levels: deeper takes the stdlib
    nested = "[" * depth + draw(numbers) + "]" * depth
    extra = draw(st.lists(st.tuples(st.sampled_from(["x_a", "x_b"]), texts), max_size=2, unique_by=lambda kv: kv[0]))
    fields = [
        '"model":"m"',
        f'"stream":{"true" if stream else "false"}',
        f'"messages":[{{"role":"user","content":{_json_str(prompt, ascii_only)}}}]',
        f'"x_number":{draw(numbers)}',
        f'"x_nested":{nested}',
        *(f'"{k}":{_json_str(v, ascii_only)}' for k, v in extra),
    ]
    splits = draw(st.lists(st.integers(1, 4000), max_size=4))
    fields.append(f'"fault":{{"echo":true,"splits":{json.dumps(splits)}}}')
    return ("{" + ",".join(fields) + "}").encode("utf-8"), prompt, stream


def test_what_the_client_sent_and_received_comes_back_exactly(proxy: RunningProxy) -> None:
    """Every generated body is sent as one call of one attempt; one GET then reads them all back
    (a GET per example would triple the run time), matched by the call id each answer carries."""
    attempt = f"prop{next(_examples)}"
    sent: dict[str, tuple[bytes, bytes, str, bool]] = {}

    with httpx.Client(timeout=30) as http:
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(case=request_bodies())
        def exchange(case: tuple[bytes, str, bool]) -> None:
            raw, _, stream = case
            # The prompt as JSON defines it: two escaped halves of a surrogate pair are one character.
            prompt = json.loads(raw)["messages"][0]["content"]
            answer = http.post(f"{proxy.base_url(attempt, '0')}/chat/completions", content=raw,
                               headers={"content-type": "application/json"})
            assert answer.status_code == 200, answer.text
            # The bytes as they arrived (no content-encoding is used).
            sent[answer.headers["x-rolltap-call-id"]] = (raw, answer.content, prompt, stream)

        exchange()
        got = http.get(f"{proxy.url}/rollout/{attempt}/attempt/0")
    assert got.status_code == 200, got.text
    record = json.loads(got.content)  # the stdlib reads lone surrogate escapes back as they were
    assert record["is_durable"] is True
    calls = {c["call_id"]: c for c in record["calls"]}
    assert len(sent) >= EXAMPLES and calls.keys() == sent.keys()
    for call_id, (raw, received, prompt, stream) in sent.items():
        call = calls[call_id]
        assert body_bytes(call, "request_body") == raw, raw
        assert body_bytes(call, "response_body") == received, raw
        assert call["status"] == "ok" and call["response_truncated"] is False and call["is_streaming"] is stream
        # The parsed copies are exact too: the prompt as sent, the completion as received.
        assert call["request"]["messages"][0]["content"] == prompt, raw
        choices = call["response"]["choices"]  # an empty echo streams no chunk at all
        assert (choices[0]["message"]["content"] if choices else "") == prompt, raw


def test_invalid_utf8_from_client_and_replica_is_kept_byte_for_byte(proxy: RunningProxy) -> None:
    with httpx.Client(timeout=30) as http:
        # Not JSON at all (invalid UTF-8): refused with 400, and recorded as sent.
        bad = b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe \xc3"}]}'
        refused = http.post(f"{proxy.base_url('utf8-bad', '0')}/chat/completions", content=bad,
                            headers={"content-type": "application/json"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_json"
        call = only_call(http, proxy, "utf8-bad")
        assert call["status"] == "invalid_request"
        assert call["request_body_encoding"] == "base64" and body_bytes(call, "request_body") == bad
        # A replica emitting invalid UTF-8 and a character split over two chunks.
        euro = "€".encode()
        chunks = [b'data: {"choices":[{"index":0,"delta":{"content":"a\xff', b'b' + euro[:2], euro[2:] + b'"}}]}\n\n',
                  b"data: [DONE]\n\n"]
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}],
                "fault": {"chunks_b64": [base64.b64encode(c).decode() for c in chunks]}}
        got = http.post(f"{proxy.base_url('utf8-replica', '0')}/chat/completions", json=body)
        assert got.status_code == 200 and got.content == b"".join(chunks)
        call = only_call(http, proxy, "utf8-replica")
    assert call["response_body_encoding"] == "base64"
    assert body_bytes(call, "response_body") == b"".join(chunks)
    # The parsed copy reads the bad byte as U+FFFD, and the split character whole.
    assert call["response"]["choices"][0]["message"]["content"] == "a\ufffdb€"


@pytest.mark.parametrize("depth", [MAX_DEPTH, 1000])
def test_nesting_too_deep_to_forward_is_refused_and_recorded_exactly(proxy: RunningProxy, depth: int) -> None:
    # `depth` lists inside the body object: one level more than the limit.
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":' + b"[" * depth + b"]" * depth + b"}"
    with httpx.Client(timeout=30) as http:
        refused = http.post(f"{proxy.base_url(f'deep{depth}', '0')}/chat/completions", content=raw,
                            headers={"content-type": "application/json"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "nesting_too_deep"
        call = only_call(http, proxy, f"deep{depth}")
    assert call["status"] == "invalid_request" and body_bytes(call, "request_body") == raw


def test_a_body_at_the_size_limit_is_kept_whole(proxy: RunningProxy) -> None:
    limit = proxy.settings.proxy.recorder.max_body_bytes
    # Escaped (6 to 12 bytes a character), the request and the echoed answer each come near the limit.
    prompt = ("\x00é😀\ud800" * (limit // 32))[: limit // 9]
    raw = json.dumps({"model": "m", "stream": False, "messages": [{"role": "user", "content": prompt}],
                      "fault": {"echo": True}}).encode()
    with httpx.Client(timeout=120) as http:
        sent = http.post(f"{proxy.base_url('big', '0')}/chat/completions", content=raw,
                         headers={"content-type": "application/json"})
        assert sent.status_code == 200
        call = only_call(http, proxy, "big")
    assert limit // 2 < len(sent.content) <= limit and call["response_truncated"] is False
    assert body_bytes(call, "request_body") == raw and body_bytes(call, "response_body") == sent.content
    assert call["response"]["choices"][0]["message"]["content"] == prompt


# -- acceptance: 32 agents x 3 calls with control characters, both ways ---------------------

AGENTS, TURNS = 32, 3
CONTROL = "".join(chr(c) for c in range(32)) + "\x7f"


async def _agent(proxy_url: str, rollout: str, http: httpx.AsyncClient, stream: bool) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=f"{proxy_url}/rollout/{rollout}/attempt/0/v1", api_key="x",
                                http_client=http, max_retries=0)
    exchanged: list[tuple[str, str]] = []
    for turn in range(TURNS):
        prompt = f"{rollout}\x00turn {turn}{CONTROL}\x00end"
        kwargs: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": prompt}],
                                  "extra_body": {"fault": {"echo": True}}}
        if stream:
            chunks = await client.chat.completions.create(stream=True, **kwargs)
            reply = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        else:
            reply = (await client.chat.completions.create(**kwargs)).choices[0].message.content or ""
        exchanged.append((prompt, reply))
    finished = await http.post(f"{proxy_url}/rollout/{rollout}/attempt/0/finish", json={"status": "succeeded"})
    assert finished.status_code == 200 and finished.json()["is_durable"] is True, finished.text
    return exchanged


def test_32_agents_with_control_characters_all_96_recorded_exactly(proxy: RunningProxy) -> None:
    async def main() -> list[list[tuple[str, str]]]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=2 * AGENTS), timeout=120) as http:
            return await asyncio.gather(*(_agent(proxy.url, f"acc{i}", http, stream=i % 2 == 0)
                                          for i in range(AGENTS)))

    exchanged = asyncio.run(main())
    recorded = 0
    with httpx.Client(timeout=30) as http:
        for i, turns in enumerate(exchanged):
            attempt = json.loads(http.get(f"{proxy.url}/rollout/acc{i}/attempt/0").content)
            assert attempt["status"] == "succeeded" and attempt["is_durable"] is True
            assert [c["seq"] for c in attempt["calls"]] == list(range(TURNS))
            for call, (prompt, reply) in zip(attempt["calls"], turns, strict=True):
                assert reply == prompt  # the completion carries the control characters back
                assert call["request"]["messages"][0]["content"] == prompt
                assert call["response"]["choices"][0]["message"]["content"] == reply
                assert json.loads(body_bytes(call, "request_body"))["messages"][0]["content"] == prompt
                recorded += 1
    assert recorded == AGENTS * TURNS


@pytest.mark.vllm
def test_control_characters_through_the_real_replica(vllm_replica: Any, proxy_for: Any, db_url: str,
                                                     tmp_path: Path) -> None:
    async def main(proxy_url: str) -> list[list[tuple[str, str]]]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=16), timeout=300) as http:
            async def agent(i: int) -> list[tuple[str, str]]:
                client = openai.AsyncOpenAI(base_url=f"{proxy_url}/rollout/real{i}/attempt/0/v1", api_key="x",
                                            http_client=http, max_retries=0)
                out = []
                for turn in range(TURNS):
                    prompt = f"say\x00 {turn}\x01\x02\x1b[0m\x7f end"
                    chunks = await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=16, stream=i % 2 == 0,
                        temperature=1.0, seed=i * 10 + turn) if i % 2 == 0 else None
                    if chunks is not None:
                        reply = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
                    else:
                        reply = (await client.chat.completions.create(
                            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=16,
                            temperature=1.0, seed=i * 10 + turn)).choices[0].message.content or ""
                    out.append((prompt, reply))
                finished = await http.post(f"{proxy_url}/rollout/real{i}/attempt/0/finish", json={})
                assert finished.status_code == 200, finished.text
                return out

            return await asyncio.gather(*(agent(i) for i in range(8)))

    with proxy_for([vllm_replica.url]) as running, httpx.Client(timeout=30) as http:
        exchanged = asyncio.run(main(running.url))
        for i, turns in enumerate(exchanged):
            attempt = json.loads(http.get(f"{running.url}/rollout/real{i}/attempt/0").content)
            assert len(attempt["calls"]) == TURNS and attempt["is_durable"] is True
            for call, (prompt, reply) in zip(attempt["calls"], turns, strict=True):
                assert call["request"]["messages"][0]["content"] == prompt
                assert call["response"]["choices"][0]["message"]["content"] == reply
                assert call["completion_token_ids"]
                assert json.loads(body_bytes(call, "request_body"))["messages"][0]["content"] == prompt
