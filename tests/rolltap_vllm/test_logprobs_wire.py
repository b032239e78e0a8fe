"""The plugin's logprob transport (rolltap_vllm/logprobs_wire.py): an API server gets the same logprobs from
the engine core as bytes as it gets from vLLM's own numpy arrays, through vLLM's real encoder, decoder and
processor, and a real `vllm serve` with the plugin answers as one without it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.logprobs_wire import run_mode
from tools.replica import VllmReplica, vllm_python

# A chat call whose every token is scored: greedy, so two servers of one model answer alike.
ASK: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "Count: one, two,"}],
                       "max_tokens": 24, "temperature": 0.0, "logprobs": True, "top_logprobs": 3,
                       "return_token_ids": True, "seed": 7}


@pytest.mark.parametrize(("requests", "width", "positions"), [(8, 1, 1), (5, 4, 3)],
                         ids=["one-token-a-step", "top3-three-tokens-a-step"])
def test_the_api_server_builds_the_same_logprobs_from_bytes(requests: int, width: int, positions: int) -> None:
    python = str(vllm_python())
    found = {mode: run_mode(mode, python, requests, width, positions, steps=60) for mode in ("numpy", "bytes")}
    assert found["bytes"]["wire"] is True and found["numpy"]["wire"] is False  # each mode really ran its transport
    assert found["bytes"]["digest"] == found["numpy"]["digest"]
    assert found["bytes"]["positions"] == found["numpy"]["positions"] == requests * positions * 60


# A vLLM release the transport was not checked against: `auto` keeps vLLM's own, `bytes` switches it anyway.
_UNCHECKED = """
import os, vllm
vllm.__version__ = "0.99.0"
from rolltap_vllm import logprobs_wire
from vllm.v1.outputs import LogprobsLists
on = logprobs_wire.install()
print(on, logprobs_wire.installed(), LogprobsLists.__annotations__["logprobs"].__name__)
"""


@pytest.mark.parametrize(("mode", "expected"), [("auto", "False False ndarray"), ("bytes", "True True bytes"),
                                                ("numpy", "False False ndarray")])
def test_an_unchecked_vllm_keeps_its_own_transport_unless_told(mode: str, expected: str) -> None:
    done = subprocess.run([str(vllm_python()), "-c", _UNCHECKED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ROLLTAP_VLLM_LOGPROBS_WIRE": mode}, check=True)
    assert done.stdout.strip().splitlines()[-1] == expected
    if mode == "auto":
        assert "vLLM 0.99.0 is not one the logprob transport was checked against" in done.stdout + done.stderr


def _answers(url: str) -> list[Any]:
    """The scored tokens of ASK, non-streamed and streamed: (token id, token, logprob, top logprobs) each."""
    whole = httpx.post(f"{url}/v1/chat/completions", json=ASK, timeout=120)
    whole.raise_for_status()
    choice = whole.json()["choices"][0]
    plain = [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
             for e in choice["logprobs"]["content"]]
    streamed: list[Any] = []
    ids: list[int] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**ASK, "stream": True}, timeout=120) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            for chunk_choice in json.loads(line[6:])["choices"]:
                ids += chunk_choice.get("token_ids") or []
                for e in (chunk_choice.get("logprobs") or {}).get("content") or []:
                    streamed.append((e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]]))
    return [choice["token_ids"], plain, ids, streamed]


def test_a_server_with_the_plugin_answers_as_vllm_alone(vllm_replica: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    if not isinstance(vllm_replica, VllmReplica):
        pytest.skip("ROLLTAP_TEST_VLLM_URL: a replica started elsewhere, whose log and transport are unknown here")
    with_plugin = _answers(vllm_replica.url)
    assert len(with_plugin[1]) == 24 and with_plugin[0] == with_plugin[2] and with_plugin[1] == with_plugin[3]
    assert b"sampled logprobs travel from the engine core as bytes" in vllm_replica.log_path.read_bytes()
    with VllmReplica(tiny_model_dir, served_model_name="tiny", max_model_len=1024,
                     log_path=tmp_path / "numpy.log", extra_env={"ROLLTAP_VLLM_LOGPROBS_WIRE": "numpy"}) as own:
        own.wait_healthy(600)
        vllm_own = _answers(own.url)
    assert b"travel from the engine core as bytes" not in (tmp_path / "numpy.log").read_bytes()
    assert with_plugin == vllm_own
