"""The Responses API (`/v1/responses`) through the templated route, with the official openai SDK and a real replica."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ProxyFactory

pytestmark = pytest.mark.vllm

PROMPT = "Tell me about the quick brown fox."


def _output_logprobs(response: Any) -> list[float]:
    return [lp.logprob for item in response.output if item.type == "message"
            for part in item.content for lp in (part.logprobs or [])]


def test_sdk_responses_create_recorded_with_tokens(vllm_replica: Any, proxy_for: ProxyFactory, tokenizer: Any) -> None:
    with proxy_for([vllm_replica.url]) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("resp", "a0"), api_key="unused")
        whole = client.responses.create(model="anything", input=PROMPT, max_output_tokens=12, temperature=0)
        events = list(client.responses.create(model="anything", input=PROMPT, max_output_tokens=12,
                                              temperature=0, stream=True))
        attempt = httpx.get(f"{proxy.url}/rollout/resp/attempt/a0", timeout=60).json()
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert whole.output_text and streamed == whole.output_text  # greedy: streamed equals whole

    calls = attempt["calls"]
    assert [c["route"] for c in calls] == ["responses", "responses"]
    assert [c["is_streaming"] for c in calls] == [False, True]
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                               tokenize=False)
    for call in calls:
        assert call["status"] == "ok", call["error"]
        assert call["policy_version"] == 0 and call["served_model"] == "tiny"
        assert call["requested_model"] == "anything"
        # The replica's own prompt: the chat template over the input, exactly.
        assert call["prompt_token_ids"] == tokenizer.encode(prompt_ids, add_special_tokens=False)
        ids = call["completion_token_ids"]
        assert ids and tokenizer.decode(ids, skip_special_tokens=True) == whole.output_text
        assert len(call["completion_logprobs"]) == len(ids)
        assert all(isinstance(lp, float) and lp <= 0 for lp in call["completion_logprobs"])
        assert call["finish_reason"] in ("stop", "length")
        # The proxy asked for tokens and logprobs upstream; the record shows what it sent.
        assert call["request"]["enable_response_messages"] is True
        assert "message.output_text.logprobs" in call["request"]["include"]
    # The client got the replica's logprobs too, and they are the recorded ones.
    assert calls[0]["completion_logprobs"] == pytest.approx(_output_logprobs(whole), abs=1e-6)


async def test_async_sdk_responses_stream_and_previous_response_id(vllm_replica: Any, proxy_for: ProxyFactory,
                                                                   tokenizer: Any) -> None:
    with proxy_for([vllm_replica.url]) as proxy:
        client = openai.AsyncOpenAI(base_url=proxy.base_url("resp2", "a0"), api_key="unused")
        first = await client.responses.create(model="m", input="Name a colour.", max_output_tokens=8,
                                              temperature=0, store=True)
        stream = await client.responses.create(model="m", input="And another?", previous_response_id=first.id,
                                               max_output_tokens=8, temperature=0, stream=True)
        events = [e async for e in stream]
        async with httpx.AsyncClient() as http:
            attempt = (await http.get(f"{proxy.url}/rollout/resp2/attempt/a0")).json()
        await client.close()
    assert events[-1].type in ("response.completed", "response.incomplete")
    one, two = attempt["calls"]
    assert two["request"]["previous_response_id"] == first.id
    # The second prompt is the first conversation (the replica kept it) followed by the new turn.
    assert two["prompt_token_ids"][:len(one["prompt_token_ids"])] == one["prompt_token_ids"]
    rendered = tokenizer.decode(two["prompt_token_ids"])
    assert rendered.endswith("<|im_start|>user\nAnd another?<|im_end|>\n<|im_start|>assistant\n")
    assert first.output_text in rendered
    assert two["completion_token_ids"] and len(two["completion_logprobs"]) == len(two["completion_token_ids"])
