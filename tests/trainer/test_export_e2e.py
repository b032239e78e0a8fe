"""A multi-turn conversation through the proxy and a real vLLM replica exports to the replica's own tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ProxyFactory

pytestmark = pytest.mark.vllm

TRAINER = str(Path(sys.executable).parent / "rolltap-trainer")


def _converse(proxy_url: str) -> list[dict[str, Any]]:
    """Three turns with the plain openai SDK; returns what the replica sent back per call."""
    client = openai.OpenAI(base_url=f"{proxy_url}/rollout/conv/attempt/0/v1", api_key="x")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Name a colour."}]
    seen = []
    for turn in range(3):
        if turn == 1:  # one streamed turn: tokens arrive chunk by chunk
            stream = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                                    stream=True)
            chunks = [c.model_dump() for c in stream]
            prompt = next(c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids"))
            ids = [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
            logprobs = [e["logprob"] for c in chunks for ch in c["choices"]
                        for e in ((ch.get("logprobs") or {}).get("content") or [])]
            text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
        else:
            out = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
            raw = out.model_dump()
            prompt, ids = raw["prompt_token_ids"], raw["choices"][0]["token_ids"]
            logprobs = [e["logprob"] for e in raw["choices"][0]["logprobs"]["content"]]
            text = out.choices[0].message.content or ""
        seen.append({"prompt": prompt, "completion": ids, "logprobs": logprobs})
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And another ({turn})?"}]
    httpx.post(f"{proxy_url}/rollout/conv/attempt/0/finish", json={"status": "succeeded", "reward": 1.0}
               ).raise_for_status()
    return seen


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_multi_turn_export_equals_replica_tokens(vllm_replica: Any, proxy_for: ProxyFactory, db_url: str,
                                                 tmp_path: Path) -> None:
    with proxy_for([vllm_replica.url]) as proxy:
        seen = _converse(proxy.url)
    out = tmp_path / "triplets.jsonl"
    # The conversation is greedy (temperature 0) so that its tokens are stable; greedy calls are
    # not reproducible sampling and are dropped from training data unless kept explicitly.
    env = {**os.environ, "ROLLTAP_TRAINER__UNREPRODUCIBLE_SAMPLING": "keep"}
    result = subprocess.run([TRAINER, "--db", db_url, "export", "--format", "jsonl", "--out", str(out),
                             "--group-size", "1", "--mark-consumed"], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and sum(len(r["call_ids"]) for r in rows) == 3  # every call is in exactly one row
    calls_in_order = iter(seen)
    for row in rows:
        merged = [next(calls_in_order) for _ in row["call_ids"]]
        assert row["prompt_ids"] == merged[0]["prompt"]  # the first call's prompt, as the replica saw it
        sequence = row["prompt_ids"] + row["response_ids"]
        assert sequence == merged[-1]["prompt"] + merged[-1]["completion"]  # ends as the last call ended
        generated = [t for t, m in zip(row["response_ids"], row["response_mask"], strict=True) if m]
        assert generated == [t for call in merged for t in call["completion"]]  # mask = exactly the replica's tokens
        row_logprobs = [lp for lp, m in zip(row["rollout_logprobs"], row["response_mask"], strict=True) if m]
        assert row_logprobs == pytest.approx([lp for call in merged for lp in call["logprobs"]], abs=1e-6)
        assert row["reward"] == 1.0 and row["policy_version"] == 0 and row["group_id"] == "conv"
    # Consumed by the export: a second one finds nothing left.
    again = subprocess.run([TRAINER, "--db", db_url, "export", "--out", str(tmp_path / "again.jsonl"),
                            "--group-size", "1"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "wrote 0 triplets" in again.stdout
