"""The web dashboard (`/ui`) on a database filled through the proxy and a real replica, driven by headless Chromium.

Debian's `chromium` is driven by Playwright (`executable_path`, no browser download). The
test signs in, filters the attempt list, opens an attempt and checks its rendered tokens
(one generated span per completion token, one masked span per token between calls), its
reward and its drop reason; the screenshots it takes are the ones in docs/ and the README.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import insert

from shared.db.engine import create_sync_db
from shared.db.models import CallDrop, TrainingStep
from shared.settings import DbSettings
from tests.conftest import ProxyFactory

pytestmark = pytest.mark.vllm

ADMIN = "t"  # tests.conftest.make_settings's admin token
AGENT_KEY = "dashboard-agent-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _fill(proxy_url: str) -> tuple[dict[str, Any], list[str]]:
    """Two attempts of task-1 (two turns each, rewards 1 and 0) and a failed task-2: task-1/a0 as recorded,
    and the token texts its second call's agent got (that turn asks for logprobs; the first does not,
    so the proxy asks for them itself, as token IDs)."""
    headers = {"authorization": f"Bearer {AGENT_KEY}"}
    texts: list[str] = []
    for rollout, attempt, reward, status in (("task-1", "a0", 1.0, "succeeded"), ("task-1", "a1", 0.0, "succeeded"),
                                             ("task-2", "a0", None, "failed")):
        client = openai.OpenAI(base_url=f"{proxy_url}/rollout/{rollout}/attempt/{attempt}/v1", api_key=AGENT_KEY)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
        for turn in range(2 if status == "succeeded" else 1):
            out = client.chat.completions.create(model="m", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                 temperature=1.0, seed=turn, logprobs=turn == 1)
            if (rollout, attempt, turn) == ("task-1", "a0", 1):
                texts = [entry.token for entry in (out.choices[0].logprobs.content or [])]  # type: ignore[union-attr]
            messages += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                         {"role": "user", "content": "Are you sure?"}]
        body: dict[str, Any] = {"status": status} | ({"reward": reward} if reward is not None else {})
        httpx.post(f"{proxy_url}/rollout/{rollout}/attempt/{attempt}/finish", json=body, headers=headers,
                   timeout=60).raise_for_status()
    return httpx.get(f"{proxy_url}/rollout/task-1/attempt/a0", headers=headers, timeout=60).json(), texts


def _trainer_rows(db_url: str, attempt: dict[str, Any]) -> None:
    """What a trainer leaves: a drop reason for one call, and per-version training steps."""
    engine = create_sync_db(DbSettings(url=db_url))
    try:
        with engine.begin() as conn:
            conn.execute(insert(CallDrop).values(call_id=attempt["calls"][1]["call_id"], rollout_id="task-1",
                                                 attempt_id="a0", reason="truncated", detail="finish_reason length"))
            conn.execute(insert(TrainingStep), [
                {"step": s, "policy_version": s // 2, "metrics": {"reward_mean": 0.2 + 0.1 * s, "entropy": 2.0 - 0.1 * s,
                                                                  "staleness_max": s % 2}} for s in range(6)])
    finally:
        engine.dispose()


def test_dashboard_is_closed_without_a_key(vllm_replica: Any, proxy_for: ProxyFactory) -> None:
    # A 60 s client timeout, not httpx's 5 s: a proxy's first PostgreSQL query on a loaded CI machine.
    with proxy_for([vllm_replica.url], open_access=False, agent_key=AGENT_KEY) as proxy, \
            httpx.Client(timeout=60) as http:
        assert http.get(f"{proxy.url}/ui").status_code == 401
        assert http.get(f"{proxy.url}/ui", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert http.get(f"{proxy.url}/ui/charts").status_code == 401
        assert http.get(f"{proxy.url}/ui/attempt/x/y").status_code == 401
        for token in (ADMIN, AGENT_KEY):
            page = http.get(f"{proxy.url}/ui", headers={"authorization": f"Bearer {token}"})
            assert page.status_code == 200 and "<h1>Attempts</h1>" in page.text
        refused = http.post(f"{proxy.url}/ui/login", data={"token": "wrong"}, follow_redirects=False)
        assert refused.status_code == 401 and "rolltap_ui" not in refused.headers.get("set-cookie", "")
        signed_in = http.post(f"{proxy.url}/ui/login", data={"token": AGENT_KEY}, follow_redirects=False)
        assert signed_in.status_code == 303 and "HttpOnly" in signed_in.headers["set-cookie"]
        # Recorded text is escaped: an agent's content never becomes markup in the dashboard.
        client = openai.OpenAI(base_url=f"{proxy.url}/rollout/evil/attempt/0/v1", api_key=AGENT_KEY)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "<script>alert(1)</script>"}],
                                       max_tokens=2)
        # `finish` returns once the attempt's calls are recorded; the dashboard reads what is recorded.
        http.post(f"{proxy.url}/rollout/evil/attempt/0/finish", json={"status": "succeeded", "reward": 0.0},
                  headers={"authorization": f"Bearer {AGENT_KEY}"}).raise_for_status()
        page = http.get(f"{proxy.url}/ui/attempt/evil/0", headers={"cookie": f"rolltap_ui={AGENT_KEY}"})
        assert page.status_code == 200 and "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        assert "<script>alert" not in page.text


# Skipped where no browser is installed, except under CI=true: .ci/run installs it, so there a
# missing browser is a failure, not a silent skip.
@pytest.mark.skipif(CHROMIUM is None and os.environ.get("CI") != "true",
                    reason="Debian `chromium` is not installed (.ci/run installs it)")
def test_dashboard_in_headless_chromium(vllm_replica: Any, proxy_for: ProxyFactory, db_url: str) -> None:
    from playwright.sync_api import sync_playwright

    with proxy_for([vllm_replica.url], open_access=False, agent_key=AGENT_KEY) as proxy:
        recorded, texts = _fill(proxy.url)
        _trainer_rows(db_url, recorded)
        first, second = recorded["calls"]
        glue = len(second["prompt_token_ids"]) - len(first["prompt_token_ids"]) - len(first["completion_token_ids"])
        assert glue > 0 and second["prompt_token_ids"][:len(first["prompt_token_ids"])] == first["prompt_token_ids"]
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(120_000)  # a loaded CI machine renders slowly; 30 s is not enough there
            page.goto(f"{proxy.url}/ui")
            assert page.locator("h1").inner_text() == "Sign in"
            page.fill("input[name=token]", ADMIN)
            page.click("form button")
            page.wait_for_selector("table.attempts")
            assert page.locator("table.attempts tbody tr").count() == 3
            page.select_option("select[name=status]", "succeeded")  # submits on change (ui.js)
            page.wait_for_url("**status=succeeded**")
            assert page.locator("table.attempts tbody tr").count() == 2
            page.fill("input[name=reward_min]", "0.5")
            page.click("form.filters button")
            page.wait_for_url("**reward_min=0.5**")
            rows = page.locator("table.attempts tbody tr")
            assert rows.count() == 1 and rows.locator("td.reward").inner_text() == "1"
            page.fill("input[name=reward_min]", "")
            page.click("form.filters button")
            page.wait_for_url("**reward_min=&**")
            DOCS.mkdir(exist_ok=True)
            page.screenshot(path=str(DOCS / "dashboard-list.png"))
            page.click("text=task-1/a0")
            page.wait_for_selector("section.call")
            assert page.locator("section.call").count() == 2
            generated = len(first["completion_token_ids"]) + len(second["completion_token_ids"])
            assert page.locator("section.call .tok.gen").count() == generated
            assert page.locator("section.call .tok.masked").count() == glue  # the user turn between the calls, masked
            assert "merge point" in page.locator(f"section[id='{second['call_id']}'] .merge").inner_text()
            assert page.locator(".badge.drop").inner_text() == "dropped: truncated"
            assert page.locator("ul.rewards .reward").inner_text() == "1"
            # Token text comes from the replica's logprobs where the agent asked for them; logprobs the proxy
            # asked for on its own are token IDs, shown as such. The tooltip has the id and the logprob.
            strip = page.locator(f"section[id='{first['call_id']}'] .tok.gen")
            assert strip.all_text_contents() == [f"#{token}" for token in first["completion_token_ids"]]
            tip = strip.first.get_attribute("title") or ""
            assert tip.startswith(f"id {first['completion_token_ids'][0]} · logprob ")
            assert len(texts) == len(second["completion_token_ids"]) and not any(t.startswith("token_id:") for t in texts)
            assert page.locator(f"section[id='{second['call_id']}'] .tok.gen").all_text_contents() == texts
            page.screenshot(path=str(DOCS / "dashboard-attempt.png"), full_page=True)
            page.goto(f"{proxy.url}/ui/charts")
            assert page.locator("figure.chart polyline").count() == 3  # reward, entropy, staleness
            assert page.locator("figure.chart").first.locator("circle").count() == 3  # versions 0, 1, 2
            assert "healthy" in page.locator("table.replicas").inner_text()
            page.screenshot(path=str(DOCS / "dashboard-charts.png"), full_page=True)
            browser.close()
