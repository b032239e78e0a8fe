"""64 concurrent streaming agents, 4 calls each, against a real vLLM replica."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import create_engine, text

from shared.db.engine import sync_url
from tests.conftest import ProxyFactory

pytestmark = pytest.mark.vllm

AGENTS, TURNS = 64, 4


async def _agent(proxy_url: str, rollout: str, http: httpx.AsyncClient) -> None:
    client = openai.AsyncOpenAI(base_url=f"{proxy_url}/rollout/{rollout}/attempt/0/v1", api_key="x",
                                http_client=http, max_retries=0)
    messages: list[dict[str, str]] = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"turn {turn}"})
        stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=4, stream=True,
                                                      temperature=0)
        reply = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        messages.append({"role": "assistant", "content": reply})
    finished = await http.post(f"{proxy_url}/rollout/{rollout}/attempt/0/finish", json={"status": "succeeded"})
    assert finished.status_code == 200, finished.text


def test_64_concurrent_streaming_agents(vllm_replica: Any, proxy_for: ProxyFactory, db_url: str) -> None:
    async def main(proxy_url: str) -> None:
        limits = httpx.Limits(max_connections=AGENTS * 2)
        async with httpx.AsyncClient(limits=limits, timeout=300) as http:
            await asyncio.gather(*(_agent(proxy_url, f"c{i}", http) for i in range(AGENTS)))

    with proxy_for([vllm_replica.url]) as proxy:
        asyncio.run(main(proxy.url))
    # Read back from a separate connection, after the proxy has stopped.
    engine = create_engine(sync_url(db_url))
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT rollout_id, attempt_id, seq, call_id, status, request FROM calls ORDER BY rollout_id, seq"
        )).all()
        statuses = dict(conn.execute(text("SELECT status, count(*) FROM attempts GROUP BY status")).all())
    engine.dispose()
    assert len(rows) == AGENTS * TURNS
    assert len({r.call_id for r in rows}) == AGENTS * TURNS
    assert statuses == {"succeeded": AGENTS}
    by_attempt: dict[str, list[Any]] = {}
    for row in rows:
        by_attempt.setdefault(row.rollout_id, []).append(row)
    assert len(by_attempt) == AGENTS
    for calls in by_attempt.values():
        assert [c.seq for c in calls] == list(range(TURNS))
        assert all(c.status == "ok" for c in calls)
        for seq, call in enumerate(calls):
            request = call.request if isinstance(call.request, dict) else json.loads(call.request)
            assert request["messages"][-1]["content"] == f"turn {seq}"  # numbered in the order they were made
