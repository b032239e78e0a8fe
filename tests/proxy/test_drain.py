"""SIGTERM drain: calls in flight finish, lifecycle routes answer meanwhile, then everything is flushed.

The proxy is a real process; 16 agents hold 2-second streams when SIGTERM arrives, and
each sends `finish` as soon as its stream ends. While they run, a new relayed call is
refused (503 `proxy_draining`, OpenAI's error shape, `Retry-After`, `x-rolltap-call-id` naming
its record), `/readyz` says draining, and reward, GET attempt and finish still answer. Every agent's finish is
answered; the process exits 0, and a new proxy on the same database finds every call
recorded and every attempt finished.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tests.support.fault_replica import FaultReplica
from tests.support.proxy_process import AgentLog, ProxyProcess, stream_turn
from tests.support.servers import free_port, serve_in_thread

AGENTS = 16


def _body(i: int) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": f"agent {i}"}], "stream": True,
            "max_tokens": 10, "fault": {"delay_s": 0.2}}


async def _agent(client: httpx.AsyncClient, url: str, i: int, log: AgentLog, finishes: list[int]) -> None:
    """A stream, then `finish` at once: the follow-up an agent sends right after its last call."""
    turn = await stream_turn(client, url, f"drain-{i}", "0", _body(i))
    log.turns.append(turn)
    finish = await client.post(f"{url}/rollout/drain-{i}/attempt/0/finish", json={"status": "succeeded"})
    finishes.append(finish.status_code)


async def _scenario(proxy: ProxyProcess, log: AgentLog, finishes: list[int]) -> dict[str, object]:
    seen: dict[str, object] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        before = await client.post(f"{proxy.url}/rollout/before/attempt/0/v1/chat/completions",
                                   json={"model": "m", "messages": []})
        assert before.status_code == 200
        agents = asyncio.gather(*(_agent(client, proxy.url, i, log, finishes) for i in range(AGENTS)))
        await asyncio.sleep(0.8)  # every stream is running (they take 2 s)
        proxy.sigterm()
        await asyncio.sleep(0.3)
        late = await client.post(f"{proxy.url}/rollout/late/attempt/0/v1/chat/completions",
                                 json={"model": "m", "messages": []})
        seen["late"] = (late.status_code, late.headers.get("retry-after"), late.json())
        seen["late_call_id"] = late.headers.get("x-rolltap-call-id")
        seen["readyz"] = (await client.get(f"{proxy.url}/readyz")).json()
        seen["reward"] = (await client.post(f"{proxy.url}/rollout/before/attempt/0/reward", json={"value": 1.0})
                          ).status_code
        seen["get"] = (await client.get(f"{proxy.url}/rollout/before/attempt/0")).json()
        finish = await client.post(f"{proxy.url}/rollout/before/attempt/0/finish", json={"status": "succeeded"})
        seen["finish"] = (finish.status_code, finish.json())
        seen["streams_running"] = sum(t.is_complete for t in log.turns) < AGENTS  # all of this while they ran
        await agents
    return seen


def test_sigterm_drains_then_flushes(db_url: str, tmp_path: Path) -> None:
    with serve_in_thread(FaultReplica()) as (replica, _):
        proxy = ProxyProcess(tmp_path, db_url, [replica], free_port(), ROLLTAP_PROXY__SHUTDOWN_TIMEOUT_S="20")
        log, finishes = AgentLog(), []
        try:
            proxy.start()
            seen = asyncio.run(_scenario(proxy, log, finishes))
            assert proxy.wait(30) == 0, proxy.log_tail()
            assert seen["streams_running"]
            assert all(t.is_complete for t in log.turns), [t for t in log.turns if not t.is_complete]
            assert finishes == [200] * AGENTS  # each agent's finish, sent after its stream ended, answered

            status, retry_after, body = seen["late"]  # type: ignore[misc]
            assert status == 503 and retry_after == "1"
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["code"] == "proxy_draining"
            assert seen["readyz"]["status"] == "not_ready" and seen["readyz"]["checks"]["draining"] is True  # type: ignore[index]
            assert seen["reward"] == 200
            status, finished = seen["finish"]  # type: ignore[misc]
            assert status == 200 and finished["is_durable"] and finished["is_complete"], finished
            assert [c["status"] for c in seen["get"]["calls"]] == ["ok"]  # type: ignore[index]

            proxy.start()  # a fresh proxy on the same database: everything was flushed
            with httpx.Client(timeout=30) as client:
                for turn in log.turns:
                    attempt = client.get(f"{proxy.url}/rollout/{turn.rollout_id}/attempt/0").json()
                    assert [(c["call_id"], c["status"]) for c in attempt["calls"]] == [(turn.call_id, "ok")]
                    assert attempt["status"] == "succeeded"
                late = client.get(f"{proxy.url}/rollout/late/attempt/0").json()
                # Refused, recorded as such, and the refusal named its record.
                assert [(c["call_id"], c["status"]) for c in late["calls"]] == [(seen["late_call_id"], "failed")]
            assert "journal: recovered" not in proxy.log_path.read_text()  # a clean stop leaves no journal
        finally:
            proxy.stop()
