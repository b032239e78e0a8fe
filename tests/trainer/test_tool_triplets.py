"""Tool-calling agents through the proxy: recorded calls become triplets whose tool results are masked out.

Two halves. The format: a fault-injecting replica answers with a Hermes `<tool_call>` reply
spelled out with the tiny model's real tokenizer (a random model cannot be made to emit it),
so the merge of a tool loop into one triplet is checked token by token. The tokens: a real
vLLM replica started with the `hermes` tool parser serves a tool loop whose call is forced
by a named `tool_choice`, and the recorded calls, tool result included, become triplets in which no
tool-result token is ever trained on.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.servers import serve_in_thread
from trainer.records import CallRow
from trainer.trajectory import BuildLimits, build_triplets

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
MESSAGES = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 2 + 3?"}]
KEEP = BuildLimits(unreproducible_sampling="keep")  # greedy calls are kept: their tokens are what is checked


def call_rows(attempt: dict[str, Any]) -> list[CallRow]:
    """The trainer's view of an attempt's calls, from the proxy's GET attempt."""
    return [CallRow(call_id=c["call_id"], seq=c["seq"], route=c["route"], status=c["status"],
                    prompt_token_ids=c["prompt_token_ids"], completion_token_ids=c["completion_token_ids"],
                    completion_logprobs=c["completion_logprobs"], finish_reason=c["finish_reason"],
                    policy_version=c["policy_version"], request=c["request"], response=c["response"],
                    replica=c["replica"], rollout_id=attempt["rollout_id"], attempt_id=attempt["attempt_id"])
            for c in attempt["calls"]]


def _encode(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _answer(prompt: list[int], completion: list[int], message: dict[str, Any], finish: str) -> dict[str, Any]:
    """A vLLM-shaped chat completion with exact tokens and one logprob per token."""
    return {"id": "chatcmpl-tool", "object": "chat.completion", "created": 1, "model": "fault-model",
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": completion,
                         "logprobs": {"content": [{"token": str(t), "logprob": -0.25, "bytes": [], "top_logprobs": []}
                                                  for t in completion]}}]}


def _run_tool(call: Any) -> str:
    args = json.loads(call.function.arguments)
    assert call.function.name == "add"
    return str(int(args["a"]) + int(args["b"]))


def test_tool_loop_merges_with_tool_result_masked(proxy_for: ProxyFactory, tiny_tokenizer: Any) -> None:
    tokenizer = tiny_tokenizer
    eos = tokenizer.eos_token_id
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    prompt1 = _encode(tokenizer, MESSAGES)
    completion1 = [*tokenizer.encode(call_text, add_special_tokens=False), eos]
    with serve_in_thread(FaultReplica()) as (replica_url, _), proxy_for([replica_url]) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("tools", "0"), api_key="unused")
        first = client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, temperature=0,
            extra_body={"fault": {"answer": _answer(prompt1, completion1, {
                "role": "assistant", "content": None, "tool_calls": [tool_call]}, "tool_calls")}})
        message = first.choices[0].message
        assert message.tool_calls and message.tool_calls[0].function.name == "add"
        result = _run_tool(message.tool_calls[0])
        messages = [*MESSAGES, message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result}]
        # What a replica sees next: the template over the whole conversation, the tool result inside.
        prompt2 = _encode(tokenizer, messages)
        completion2 = [*tokenizer.encode("The sum is 5.", add_special_tokens=False), eos]
        client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, temperature=0,
            extra_body={"fault": {"answer": _answer(prompt2, completion2, {
                "role": "assistant", "content": "The sum is 5."}, "stop")}})
        attempt = httpx.get(f"{proxy.url}/rollout/tools/attempt/0", timeout=60).json()

    recorded = attempt["calls"]
    assert [c["finish_reason"] for c in recorded] == ["tool_calls", "stop"]
    assert recorded[0]["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"
    assert recorded[1]["request"]["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "5"}

    triplets, drops = build_triplets(call_rows(attempt), KEEP)
    assert drops == [] and len(triplets) == 1  # the tool loop is one training sequence
    row = triplets[0]
    assert row.prompt_ids == prompt1
    assert row.prompt_ids + row.response_ids == prompt2 + completion2
    generated = [t for t, m in zip(row.response_ids, row.response_mask, strict=True) if m]
    assert generated == completion1 + completion2  # the model's own tokens, the tool call included
    glue = [t for t, m in zip(row.response_ids, row.response_mask, strict=True) if not m]
    assert tokenizer.decode(glue) == "\n<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
                                     "<|im_start|>assistant\n"  # the tool's answer: in the sequence, out of the loss
    masked_logprobs = [lp for lp, m in zip(row.response_logprobs or [], row.response_mask, strict=True) if not m]
    assert masked_logprobs == [0.0] * len(glue)


@pytest.mark.vllm
def test_real_replica_tool_loop_never_trains_on_tool_results(vllm_replica: Any, proxy_for: ProxyFactory,
                                                             tokenizer: Any) -> None:
    with proxy_for([vllm_replica.url]) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("tools-real", "0"), api_key="unused")
        # A named tool: the replica constrains the output to a Hermes block calling it (a random model
        # emits none on its own) and its `hermes` parser returns it as a tool call.
        first = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=1,
                                               tool_choice={"type": "function", "function": {"name": "add"}})
        message = first.choices[0].message
        assert message.tool_calls, message
        messages = [*MESSAGES, message.model_dump(exclude_none=True)]
        results = []
        for call in message.tool_calls:
            results.append(_run_tool(call))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": results[-1]})
        client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=16, seed=2)
        attempt = httpx.get(f"{proxy.url}/rollout/tools-real/attempt/0", timeout=60).json()

    one, two = attempt["calls"]
    recorded_call = one["response"]["choices"][0]["message"]["tool_calls"][0]["function"]
    assert recorded_call["name"] == "add"
    # The call is what the model generated (a Hermes block the replica parsed): in its completion tokens.
    generated = tokenizer.decode(one["completion_token_ids"], skip_special_tokens=True)
    assert generated.startswith('<tool_call>\n{"name": "add", "arguments": ') and generated.endswith("</tool_call>")
    # The replica rendered the tool results into the next prompt.
    assert all(f"<tool_response>\n{r}\n</tool_response>" in tokenizer.decode(two["prompt_token_ids"]) for r in results)

    triplets, drops = build_triplets(call_rows(attempt), KEEP)
    assert drops == []
    by_id = {c["call_id"]: c for c in attempt["calls"]}
    for row in triplets:
        generated = [t for t, m in zip(row.response_ids, row.response_mask, strict=True) if m]
        # Trained tokens are exactly what the model generated, its tool call included.
        assert generated == [t for cid in row.call_ids for t in by_id[cid]["completion_token_ids"]]
    # The tool results are never trained on: in the masked glue when the two turns merged, in the
    # second triplet's prompt when they did not (the template re-rendered the call differently).
    row = next(r for r in triplets if two["call_id"] in r.call_ids)
    if one["call_id"] in row.call_ids:
        where = tokenizer.decode([t for t, m in zip(row.response_ids, row.response_mask, strict=True) if not m])
    else:
        where = tokenizer.decode(row.prompt_ids)
    assert all(f"<tool_response>\n{r}\n</tool_response>" in where for r in results)
