"""A LoRA push through the proxy, timed, and the proof that every front end serves it afterwards.

Used by `bench.weight_push` (push times per rank and transport) and `bench.rollout_throughput`
(a group of servers with runtime LoRA, its calls served by the pushed adapter, as Rolltap's default
`trainer.lora_rank = 8` serves them after the first push).

The proof, after the last push: each front end asked directly at temperature 0 for the adapter
answers the same, and differently from the base model and from the version before (by its text or
by the top logprobs of its first tokens: a model with dummy weights may say the same whatever the
adapter, measured on a 135M shape); then calls through the proxy, one per front end at a time in
waves until the balancer has sent one to each (at most `MAX_WAVES`), must each be recorded with the
new version and answer what the front ends answered directly.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from trainer.weights import WeightPusher, lora_name

__all__ = ["LORA_TARGETS", "push_and_check", "random_adapter"]

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Greedy, long enough that a changed policy shows in the text.
PROBE = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 16, "temperature": 0,
         "ignore_eos": True}
MAX_WAVES = 25
# Two answers are the same policy's when their texts match and their first tokens' top logprobs are within
# this (nats); bf16 on one GPU kind repeats itself far closer, a changed adapter moves them far more.
SAME_LOGPROBS = 0.05


def random_adapter(model_dir: Path, rank: int, out: Path, seed: int, scale: float = 0.01) -> Path:
    """A PEFT adapter of `rank` on every linear layer of the model in `model_dir`, random A and B of
    standard deviation `scale` (what vLLM loads)."""
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads", heads)) * head_dim
    dims = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module, (fan_in, fan_out) in dims.items():
            part = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * scale).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * scale).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": LORA_TARGETS, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "base_model_name_or_path": str(model_dir), "inference_mode": True}))
    return out


Answer = tuple[str, list[list[float]]]  # the text, and the top-5 logprobs of its first 4 tokens


def _direct(url: str, model: str) -> Answer:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, **PROBE, "logprobs": True, "top_logprobs": 5},
                   timeout=300)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    tops = [[t["logprob"] for t in token["top_logprobs"]] for token in choice["logprobs"]["content"][:4]]
    return str(choice["message"]["content"]), tops


def _same(a: Answer, b: Answer) -> bool:
    return a[0] == b[0] and all(abs(x - y) <= SAME_LOGPROBS for p, q in zip(a[1], b[1], strict=True)
                                for x, y in zip(p, q, strict=True))


def _through(proxy: str, rollout: str) -> tuple[str, dict[str, Any]]:
    base = f"{proxy}/rollout/{rollout}/attempt/0"
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": "x", **PROBE}, timeout=300)
    r.raise_for_status()
    (call,) = httpx.get(base, timeout=60).json()["calls"]
    return str(r.json()["choices"][0]["message"]["content"]), call


def push_and_check(proxy: str, admin_token: str, fronts: list[str], model_dir: Path, work: Path, *, rank: int,
                   pushes: int, base_model: str, tag: str) -> dict[str, Any]:
    """Push `pushes` random rank-`rank` adapters through `proxy` (versions 1..pushes), time each, and check
    that the last reached every one of `fronts`. Returns the timings and what the check saw; `ok` says
    whether it held. `tag` keeps the check's rollout ids apart from other runs on the same database."""
    seconds: list[float] = []
    answers: dict[str, dict[str, Answer]] = {"base": {url: _direct(url, base_model) for url in fronts}}
    with WeightPusher(proxy, admin_token, timeout_s=900) as pusher:
        for version in range(1, pushes + 1):
            adapter = random_adapter(model_dir, rank, work / f"adapter-{tag}-v{version}", seed=version, scale=0.05)
            result = pusher.push_lora(version, adapter, base_model=base_model)
            if sorted(result.pushed) != sorted(fronts) or result.drained:
                raise RuntimeError(f"push v{version} reached {result.pushed}, drained {result.drained}")
            seconds.append(round(result.seconds, 3))
            if version >= pushes - 1:  # the last two: the last must differ from the one before
                answers[f"v{version}"] = {url: _direct(url, lora_name(version)) for url in fronts}
    # Waves of one call per front end at once: the balancer spreads them, and each front end decodes a
    # batch of one, as it did when asked directly (a larger batch may round a near tie the other way).
    spread: list[tuple[str, dict[str, Any]]] = []
    with ThreadPoolExecutor(len(fronts)) as pool:
        for wave in range(MAX_WAVES):
            spread += pool.map(lambda i, w=wave: _through(proxy, f"push-check-{tag}-{w}-{i}"), range(len(fronts)))
            if {call["replica"] for _, call in spread} == set(fronts):
                break
    last = list(answers[f"v{pushes}"].values())
    previous = list(answers[f"v{pushes - 1}"].values()) if pushes > 1 else []
    served = sorted({call["replica"] for _, call in spread})
    checks = {
        "every_front_end_answers_alike": all(_same(last[0], other) for other in last),
        "differs_from_base": not any(_same(last[0], base) for base in answers["base"].values()),
        "differs_from_previous_version": not any(_same(last[0], old) for old in previous),
        "calls_reach_every_front_end": served == sorted(fronts),
        "calls_recorded_with_new_version": {call["policy_version"] for _, call in spread} == {pushes},
        "calls_answer_as_front_ends": {text for text, _ in spread} == {text for text, _ in last},
    }
    return {"rank": rank, "front_ends": len(fronts), "push_s": seconds, "served_by": served,
            "probe_calls": len(spread), "answers": answers, "checks": checks, "ok": all(checks.values())}
