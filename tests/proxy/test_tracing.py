"""OpenTelemetry traces: one span per call, joined to the caller's trace, passed on to the replica."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ProxyFactory
from tests.support.fault_replica import MODEL, FaultReplica
from tests.support.otlp_collector import OtlpCollector, attributes
from tests.support.servers import serve_in_thread

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox."}]
SPAN_KIND_SERVER, STATUS_OK, STATUS_ERROR = 2, 1, 2


def _tracing(collector: OtlpCollector) -> dict[str, Any]:
    return {"tracing": {"otlp_endpoint": collector.endpoint, "export_interval_s": 0.1}}


@pytest.mark.vllm
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # spans do not depend on the backend
def test_spans_join_the_callers_trace_and_carry_the_record(vllm_replica: Any, proxy_for: ProxyFactory) -> None:
    with OtlpCollector() as collector:
        with proxy_for([vllm_replica.url], **_tracing(collector)) as proxy:
            traced = openai.OpenAI(base_url=proxy.base_url("r1", "a1"), api_key="unused",
                                   default_headers={"traceparent": TRACEPARENT})
            traced.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8)
            stream = traced.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, stream=True)
            assert [c for c in stream]
            untraced = openai.OpenAI(base_url=proxy.base_url("r1", "a1"), api_key="unused")
            untraced.completions.create(model="m", prompt="the quick", max_tokens=4)
            with httpx.Client(timeout=30) as http:
                bad = http.post(f"{proxy.base_url('r1', 'a1')}/chat/completions", content=b"{not json",
                                headers={"traceparent": TRACEPARENT, "content-type": "application/json"})
                assert bad.status_code == 400
                calls = http.get(f"{proxy.url}/rollout/r1/attempt/a1").json()["calls"]
        spans = collector.spans()  # the proxy's shutdown flushed the exporter

    assert len(calls) == 4 and len(spans) == 4
    by_call = {attributes(span.attributes)["rolltap.call_id"]: (resource, span) for resource, span in spans}
    assert set(by_call) == {c["call_id"] for c in calls}
    for call in calls:
        resource, span = by_call[call["call_id"]]
        attrs = attributes(span.attributes)
        assert resource["service.name"] == "rolltap-proxy"
        assert span.kind == SPAN_KIND_SERVER and span.name == f"rolltap {call['route']}"
        assert attrs["rolltap.rollout_id"] == "r1" and attrs["rolltap.attempt_id"] == "a1"
        assert attrs["rolltap.status"] == call["status"]
        assert span.start_time_unix_nano < span.end_time_unix_nano
        if call["route"] == "completions":  # sent without a traceparent: a trace of its own
            assert span.trace_id.hex() != TRACE_ID and not span.parent_span_id
        else:
            assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
        if call["status"] == "ok":
            assert span.status.code == STATUS_OK
            assert attrs["rolltap.replica"] == vllm_replica.url and attrs["rolltap.policy_version"] == 0
            assert attrs["gen_ai.response.model"] == "tiny" and attrs["gen_ai.request.model"] == "m"
            assert attrs["gen_ai.usage.input_tokens"] == len(call["prompt_token_ids"])
            assert attrs["gen_ai.usage.output_tokens"] == len(call["completion_token_ids"])
            assert attrs["gen_ai.response.finish_reasons"] == [call["finish_reason"]]
            assert attrs["rolltap.streaming"] is call["is_streaming"]
        else:
            assert call["status"] == "invalid_request"
            assert span.status.code == STATUS_ERROR and attrs["error.type"] == call["error"]["type"]
    assert sorted(a["rolltap.streaming"] for a in (attributes(s.attributes) for _, s in spans)) == [
        False, False, False, True]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_replica_gets_the_proxy_span_as_parent(proxy_for: ProxyFactory) -> None:
    replica = FaultReplica()
    with OtlpCollector() as collector, serve_in_thread(replica) as (url, _):
        with proxy_for([url], **_tracing(collector)) as proxy, httpx.Client(timeout=30) as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            http.post(f"{proxy.base_url('r1', 'a1')}/chat/completions", json=body,
                      headers={"traceparent": TRACEPARENT}).raise_for_status()
        ((_, span),) = collector.spans()
    (sent,) = [h for h in replica.stats.headers if "traceparent" in h]
    version, trace_id, parent_id, flags = sent["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert parent_id == span.span_id.hex() != PARENT_ID  # the proxy's span, not the agent's


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_hosted_call_passes_the_trace_on_through_litellm(proxy_for: ProxyFactory, tmp_path: Any) -> None:
    provider = FaultReplica()  # stands in for any OpenAI-compatible provider LiteLLM routes to
    with OtlpCollector() as collector, serve_in_thread(provider) as (url, _):
        config = tmp_path / "models.yaml"
        config.write_text("model_list:\n  - model_name: hosted-x\n    litellm_params:\n"
                          f"      model: openai/{MODEL}\n      api_base: {url}/v1\n      api_key: none\n")
        with proxy_for([url], litellm_config=str(config), **_tracing(collector)) as proxy, \
                httpx.Client(timeout=60) as http:
            body = {"model": "hosted-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            http.post(f"{proxy.base_url('r1', 'a1')}/chat/completions", json=body,
                      headers={"traceparent": TRACEPARENT}).raise_for_status()
        ((_, span),) = collector.spans()
    assert attributes(span.attributes)["rolltap.replica"] == "litellm:hosted-x"
    (sent,) = [h for h in provider.stats.headers if "traceparent" in h]
    assert sent["traceparent"] == f"00-{TRACE_ID}-{span.span_id.hex()}-01"


def test_tracing_off_imports_no_sdk() -> None:
    code = ("import sys; from proxy.tracing import load_tracing; from proxy.app import create_app; "
            "from shared.settings import Settings; s = Settings(); assert load_tracing(s.proxy.tracing) is None; "
            "create_app(s); assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')], 'imported'")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLTAP_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
