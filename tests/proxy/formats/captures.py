"""Real vLLM 0.27.1 wire captures (`data/`) for the format tests.

The tiny test model, greedy or seeded, so the streamed and non-streamed answers to one
request are the same tokens; `index.json` records each capture's request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proxy.sse import iter_data

DATA = Path(__file__).parent / "data"
INDEX: dict[str, Any] = json.loads((DATA / "index.json").read_text())

# (streamed capture, non-streamed capture of the same request)
OPENAI_PAIRS = [
    ("chat_stream", "chat_nonstream"),
    ("chat_stream_usage", "chat_nonstream"),
    ("chat_eos_bias_stream", "chat_eos_bias_nonstream"),  # ends on EOS: finish_reason "stop"
    ("chat_special_bias_stream", "chat_special_bias_nonstream"),  # special tokens: in ids, not in text
    ("chat_n2_sampled_stream", "chat_n2_sampled_nonstream"),  # n=2, interleaved choices, seeded
    ("completions_str_logprobs1_stream", "completions_str_logprobs1_nonstream"),
    ("completions_ids_logprobs1_stream", "completions_ids_logprobs1_nonstream"),
]


def route_of(name: str) -> str:
    return str(INDEX[name]["path"]).removeprefix("/v1/")


def raw(name: str) -> bytes:
    return (DATA / INDEX[name]["file"]).read_bytes()


def stream(name: str) -> list[bytes]:
    """The `data:` payloads of a streamed capture."""
    return list(iter_data(raw(name)))


def whole(name: str) -> dict[str, Any]:
    value = json.loads((DATA / INDEX[name]["file"]).read_text())
    assert isinstance(value, dict)
    return value
