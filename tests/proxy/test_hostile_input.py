"""Hostile input on the lifecycle routes: what one database stores the other stores too, or both refuse.

Registration (`task`, `metadata`), rewards (`name`, `call_id`, `value`) and finish (`reward`)
with U+0000, lone surrogates (sent as raw JSON escapes), control characters and numbers beyond
float64: each field either comes back exactly through `GET /rollout/.../attempt/...`, or is
refused with a 400 that names it; never a 503 (a client honouring its Retry-After would retry
forever). A genuine data error from the database is a 400 too. Real proxy under uvicorn, the
fault replica, both databases.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import insert, text

from proxy.recorder import Recorder
from shared.db.engine import create_async_db
from shared.db.migrate import upgrade
from shared.db.models import Attempt, Reward, Rollout
from shared.errors import InvalidRequest
from shared.settings import DbSettings
from shared.verbatim import dumps_exact, loads_exact
from tests.conftest import DB_KINDS, make_settings
from tests.support.databases import database, postgres_database
from tests.support.servers import RunningProxy, run_proxy

_ids = itertools.count()
JSON = {"content-type": "application/json"}

# JSON literals as a client writes them: each element is sent raw (escapes stay escapes).
HOSTILE_STRINGS = ['"\\u0000"', '"a\\u0000b"', '"\\ud800"', '"x\\udfffy"', '"\\ud83d"', '"\\u0001\\u001f\\u007f"',
                   '"\\t\\n\\r"', '"\\u2028"', '"\\ud83d\\ude00"', '"\\ufffd"', '"é€"']
HOSTILE_NUMBERS = ["1e400", "-1e400", "1E+999", "123456789012345678901234567890", "-0", "1e-400", "0.1"]


@pytest.fixture(scope="module", params=DB_KINDS)
def proxy(request: pytest.FixtureRequest, replica: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProxy]:
    tmp = tmp_path_factory.mktemp(f"hostile-{request.param}")
    with database(request.param, tmp) as url, run_proxy(make_settings(url, [replica], tmp)) as running:
        yield running


def _attempt(http: httpx.Client, proxy: RunningProxy, rollout: str) -> dict[str, Any]:
    got = http.get(f"{proxy.url}/rollout/{rollout}/attempt/0")
    assert got.status_code == 200, got.text
    read: dict[str, Any] = loads_exact(got.content)  # lone surrogate escapes and wide numbers as sent
    return read


def _refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, (param, response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error


def test_task_and_metadata_come_back_exactly(proxy: RunningProxy) -> None:
    values = HOSTILE_STRINGS + HOSTILE_NUMBERS
    keys = HOSTILE_STRINGS  # object keys with U+0000 and lone surrogates too
    task = "[" + ",".join(values) + ',{"deep":[[' + ",".join(values) + "]]}]"
    metadata = "{" + ",".join(f"{k}:{v}" for k, v in zip(keys, itertools.cycle(values))) + "}"
    cases = [(task, metadata), (values[0], "{}"), ("1e400", '{"n":1e400}'), ('"plain"', '{"ok":1}'),
             *((v, "{" + f'"k":{v}' + "}") for v in values)]
    with httpx.Client(timeout=30) as http:
        for task_json, metadata_json in cases:
            rollout = f"exact-{next(_ids)}"
            raw = f'{{"rollout_id":"{rollout}","task":{task_json},"metadata":{metadata_json}}}'.encode()
            registered = http.post(f"{proxy.url}/rollouts", content=raw, headers=JSON)
            assert registered.status_code == 200, (raw, registered.text)
            assert http.post(f"{proxy.url}/rollout/{rollout}/attempt/0/finish", json={}).status_code == 200
            read = _attempt(http, proxy, rollout)
            sent = loads_exact(raw)
            # dumps_exact writes a wide number's literal as sent: equal text means equal values.
            assert dumps_exact(read["task"]) == dumps_exact(sent["task"]), raw
            assert dumps_exact(read["metadata"]) == dumps_exact(sent["metadata"]), raw
        # Registering again replaces both, exact copy included.
        raw = f'{{"rollout_id":"{rollout}","task":"\\u0000 again","metadata":{{"n":2}}}}'.encode()
        assert http.post(f"{proxy.url}/rollouts", content=raw, headers=JSON).status_code == 200
        read = _attempt(http, proxy, rollout)
        assert (read["task"], read["metadata"]) == ("\x00 again", {"n": 2})


def test_unstorable_short_text_is_refused_naming_the_field(proxy: RunningProxy) -> None:
    rollout = f"text-{next(_ids)}"
    base = f"{proxy.url}/rollout/{rollout}/attempt/0"
    with httpx.Client(timeout=30) as http:
        for field in ("name", "call_id"):
            for literal in ('"\\u0000"', '"a\\u0000"', '"\\ud800"', '"b\\udfff"'):
                raw = f'{{"value":1,"{field}":{literal}}}'.encode()
                _refused(http.post(f"{base}/reward", content=raw, headers=JSON), field)
        for field in ("rollout_id", "group_id"):
            for literal in ('"\\u0000"', '"\\ud800"', '"a\\u0001"'):
                body = {"rollout_id": json.dumps(rollout), "group_id": '"g"', field: literal}
                raw = ("{" + ",".join(f'"{k}":{v}' for k, v in body.items()) + "}").encode()
                _refused(http.post(f"{proxy.url}/rollouts", content=raw, headers=JSON), field)
        # Control characters and astral ones are storable: they come back exactly.
        names = ["\x01\x1f\x7f", "\t\n\r", "\u2028", "😀", "é" * 128]
        for name in names:
            assert http.post(f"{base}/reward", json={"value": 1, "name": name}).status_code == 200
        assert http.post(f"{base}/finish", json={}).status_code == 200
        read = _attempt(http, proxy, rollout)
    assert [r["name"] for r in read["rewards"]] == names


def test_rewards_beyond_max_abs_reward_are_refused(proxy: RunningProxy) -> None:
    limit = proxy.settings.proxy.limits.max_abs_reward
    rollout = f"bound-{next(_ids)}"
    base = f"{proxy.url}/rollout/{rollout}/attempt/0"
    with httpx.Client(timeout=30) as http:
        for value in (1e308, -1e308, limit * 1.5, -limit * 1.5):
            refused = http.post(f"{base}/reward", json={"value": value})
            _refused(refused, "value")
            assert refused.json()["error"]["code"] == "reward_out_of_range"
            _refused(http.post(f"{base}/finish", json={"reward": value}), "reward")
        for value in (limit, -limit):
            assert http.post(f"{base}/reward", json={"value": value}).status_code == 200
        assert http.post(f"{base}/finish", json={"reward": -limit}).status_code == 200
        read = _attempt(http, proxy, rollout)
    assert [r["value"] for r in read["rewards"]] == [limit, -limit, -limit]
    assert read["status"] == "succeeded"  # the refused finishes changed nothing


def test_relayed_errors_carry_the_call_id_of_their_record(proxy: RunningProxy) -> None:
    rollout = f"badjson-{next(_ids)}"
    with httpx.Client(timeout=30) as http:
        refused = http.post(f"{proxy.base_url(rollout, '0')}/chat/completions", content=b'{"model": ', headers=JSON)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_json"
        call_id = refused.headers["x-rolltap-call-id"]
        [call] = _attempt(http, proxy, rollout)["calls"]
    assert (call["call_id"], call["status"]) == (call_id, "invalid_request")


def test_a_data_error_from_the_database_is_a_400(tmp_path: Path) -> None:
    """What the routes' checks let through and PostgreSQL still refuses (a value too long, a
    division by zero: SQLSTATE class 22) fails the same way on every retry: 400, not 503."""

    async def scenario(url: str) -> list[Exception]:
        settings = make_settings(url, [], tmp_path)
        engine = create_async_db(settings.db)
        recorder = Recorder(settings.proxy.recorder, engine)
        await recorder.start()
        refused: list[Exception] = []
        try:
            async def too_long(conn: Any) -> None:
                await conn.execute(insert(Rollout).values(rollout_id="r"))
                await conn.execute(insert(Attempt).values(rollout_id="r", attempt_id="0"))
                await conn.execute(insert(Reward).values(rollout_id="r", attempt_id="0", value=1.0, name="x" * 129))

            async def divide(conn: Any) -> None:
                await conn.execute(text("SELECT 1 / 0"))

            for op in (too_long, divide):
                with pytest.raises(InvalidRequest) as caught:
                    await recorder.run(op, 30.0)
                refused.append(caught.value)
            assert recorder.is_db_healthy  # not taken for an outage
        finally:
            await recorder.stop(10.0)
            await engine.dispose()
        return refused

    with postgres_database() as url:
        upgrade(DbSettings(url=url))
        refused = asyncio.run(scenario(url))
    assert [e.code for e in refused] == ["invalid_value", "invalid_value"]
    assert "too long" in refused[0].message and "division by zero" in refused[1].message


# Answers no format reads: entries of `logprobs.content` that are not objects, a `choices` that is
# not a list of choices. The client gets the bytes as sent; the record must still be written.
UNREADABLE_ANSWERS = [
    {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "logprobs": {"content": [1, "x"]}}]},
    {"choices": [{"index": 0, "message": {"content": "x"}, "token_ids": [5], "logprobs": {"content": [None]}}]},
]
UNREADABLE_STREAM = [
    'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[5],"logprobs":{"content":[1]}}]}\n\n',
    "data: [DONE]\n\n",
]


def test_an_answer_no_format_reads_is_still_recorded_and_finish_returns(proxy: RunningProxy) -> None:
    rollout = f"unreadable-{next(_ids)}"
    chat = f"{proxy.base_url(rollout, '0')}/chat/completions"
    with httpx.Client(timeout=30) as http:
        sent = []
        for answer in UNREADABLE_ANSWERS:
            got = http.post(chat, json={"model": "m", "messages": [], "fault": {"answer": answer}})
            assert got.status_code == 200 and got.json() == answer  # relayed as the replica sent it
            sent.append(got.content)
        got = http.post(chat, json={"model": "m", "messages": [], "stream": True, "fault": {"chunks": UNREADABLE_STREAM}})
        assert got.status_code == 200 and got.content == "".join(UNREADABLE_STREAM).encode()
        sent.append(got.content)
        finished = http.post(f"{proxy.url}/rollout/{rollout}/attempt/0/finish", json={"reward": 1.0})
        assert finished.status_code == 200, finished.text  # no record left unwritten for it to wait on
        calls = _attempt(http, proxy, rollout)["calls"]
    assert [call["status"] for call in calls] == ["upstream_error"] * 3
    assert {call["error"]["code"] for call in calls} == {"unreadable_response"}
    assert [call["completion_token_ids"] for call in calls] == [None] * 3
    for call, body in zip(calls, sent, strict=True):
        kept = call["response_body"]
        assert (kept.encode() if call["response_body_encoding"] == "utf-8" else base64.b64decode(kept)) == body
