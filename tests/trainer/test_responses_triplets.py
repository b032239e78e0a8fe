"""Multi-turn Responses API conversations through the proxy become triplets like chat turns."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ProxyFactory
from tests.trainer.test_tool_triplets import KEEP, call_rows
from trainer.trajectory import build_triplets

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("chained", [False, True], ids=["full-input", "previous-response-id"])
def test_responses_turns_merge_like_chat_turns(chained: bool, vllm_replica: Any, proxy_for: ProxyFactory,
                                               tokenizer: Any) -> None:
    with proxy_for([vllm_replica.url]) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("resp-merge", "0"), api_key="unused")
        first = client.responses.create(model="m", input="Name a colour.", max_output_tokens=6, temperature=0)
        if chained:
            events = list(client.responses.create(model="m", input="And another?", previous_response_id=first.id,
                                                  max_output_tokens=6, temperature=0, stream=True))
            assert events[-1].type in ("response.completed", "response.incomplete")
        else:
            history: list[Any] = [{"role": "user", "content": "Name a colour."},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "And another?"}]
            client.responses.create(model="m", input=history, max_output_tokens=6, temperature=0)
        attempt = httpx.get(f"{proxy.url}/rollout/resp-merge/attempt/0", timeout=60).json()
    one, two = attempt["calls"]
    assert all(c["status"] == "ok" and c["completion_token_ids"] for c in (one, two))
    triplets, drops = build_triplets(call_rows(attempt), KEEP)
    assert drops == []
    for row in triplets:  # the trained tokens are exactly the generated ones
        generated = [t for t, m in zip(row.response_ids, row.response_mask, strict=True) if m]
        assert generated == [t for c in (one, two) if c["call_id"] in row.call_ids for t in c["completion_token_ids"]]
    if len(triplets) == 1:  # merged: the user's next turn sits between the calls, masked
        glue = [t for t, m in zip(triplets[0].response_ids, triplets[0].response_mask, strict=True) if not m]
        assert tokenizer.decode(glue).endswith("<|im_start|>user\nAnd another?<|im_end|>\n<|im_start|>assistant\n")
    else:  # the replica re-tokenised the first reply differently: a new sequence, as for chat
        assert two["prompt_token_ids"][:len(one["prompt_token_ids"])] == one["prompt_token_ids"]
