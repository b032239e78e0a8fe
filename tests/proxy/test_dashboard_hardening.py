"""Dashboard and admin input (issue 22): bad filters and admin bodies are 400s, never 500s; any recorded
JSON renders, escaped; the sign-in cookie is Secure over HTTPS and cross-site sign-ins are refused."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert

from proxy import ui
from proxy.app import create_app
from proxy.main import server_config
from shared.db.engine import create_sync_db
from shared.db.models import Attempt, Call, Rollout
from shared.settings import DbSettings
from tests.conftest import ProxyFactory, make_settings
from tests.support.fault_replica import MODEL
from tests.support.servers import free_port, serve_in_thread

AUTH = {"authorization": "Bearer t"}
SHAPE = {"message", "type", "param", "code"}
XSS = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


# -- filters ------------------------------------------------------------------------------------------------

BAD_FILTERS = [
    "version=99999999999999999999",  # past 64 bits: SQLite's driver refused to bind it (500)
    "version=2147483648",  # past INTEGER: PostgreSQL's driver refused it (500)
    "version=-1", "version=abc", "version=1.5", "version=" + "9" * 5000,
    "before=0", "before=-5", "before=9223372036854775808", "before=99999999999999999999",
    "reward_min=nan", "reward_max=inf", "reward_min=-inf", "reward_min=1e999", "reward_max=x",
    "since=99999-01-01", "since=0000-00-00", "until=2024-13-01", "since=yesterday",
    "until=0001-01-01T00:00:00%2B05:00", "since=9999-12-31T23:59:59-05:00",  # out of range once in UTC
    "group=%00", "group=a%20b", "group=" + "g" * 129, "group=..",
    "status=%00", "status=nope",
]
EDGE_FILTERS = [  # the bounds themselves are fine, and reach the database
    "version=0", "version=2147483647", "before=1", "before=9223372036854775807",
    "reward_min=-1e308&reward_max=1e308", "since=0001-01-01", "until=9999-12-31T23:59:59.999999",
    "since=2024-01-01T00:00:00%2B05:00", "group=" + "g" * 128, "status=failed",
]


def test_bad_filters_are_400_pages(proxy_for: ProxyFactory, replica: str) -> None:
    with proxy_for([replica]) as proxy:
        for query in BAD_FILTERS:
            # A client per query: a 500 closed its connection, which would fail the next one instead.
            page = httpx.get(f"{proxy.url}/ui?{query}", headers=AUTH, timeout=60)
            assert page.status_code == 400, query
            assert page.headers["content-type"].startswith("text/html") and "<h1>400</h1>" in page.text, query
            name = query.partition("=")[0]
            assert f"filter {name}:" in page.text or f"{name} must be" in page.text, query
        for query in EDGE_FILTERS:
            page = httpx.get(f"{proxy.url}/ui?{query}", headers=AUTH, timeout=60)
            assert page.status_code == 200 and "<h1>Attempts</h1>" in page.text, query


# -- admin bodies --------------------------------------------------------------------------------------------

def _send(http: httpx.Client, method: str, url: str, body: str) -> httpx.Response:
    # Raw text: Python's json writes Infinity and NaN, and "\ud800" escapes, which the proxy's parser takes.
    return http.request(method, url, content=body, headers={**AUTH, "content-type": "application/json"})


def test_admin_bodies_past_their_columns_are_400(proxy_for: ProxyFactory, replica: str) -> None:
    policy = {"served_name": MODEL}
    bad: list[tuple[str, str, dict[str, Any] | str]] = [
        ("PUT", "/admin/policy", {**policy, "version": 10**30}),  # the case: 500 before
        ("PUT", "/admin/policy", {**policy, "version": 2**31}),  # past INTEGER
        ("PUT", "/admin/policy", {**policy, "version": -1}),
        ("PUT", "/admin/policy", {"version": 1, "served_name": "a\u0000b"}),  # PostgreSQL stores no U+0000
        ("PUT", "/admin/policy", '{"version": 1, "served_name": "\\ud800"}'),  # a lone surrogate
        ("PUT", "/admin/policy", {"version": 1, "served_name": "s" * 257}),
        ("PUT", "/admin/policy", {**policy, "version": 1, "base_model": "b" * 257}),  # VARCHAR(256)
        ("PUT", "/admin/policy", {**policy, "version": 1, "path": "/a\u0000"}),
        ("POST", "/admin/replicas", {"url": "http://" + "h" * 600}),  # VARCHAR(512)
        ("POST", "/admin/replicas", {"url": "http://a\u0000b:8000"}),
        ("POST", "/admin/replicas", '{"url": "http://\\ud800:8000"}'),
        ("POST", "/admin/replicas", {"url": "http://[::1:8000"}),
        ("POST", "/admin/replicas", {"url": "http://host:99999"}),
        ("POST", "/admin/replicas", {"url": "http://"}),
        ("POST", "/admin/replicas", {"url": "http://a b:8000"}),
        ("POST", "/admin/replicas/drain", {"url": replica, "timeout_s": 1e308}),
        ("POST", "/admin/pause", '{"timeout_s": Infinity}'),
        ("POST", "/admin/pause", '{"timeout_s": NaN}'),
        ("POST", "/admin/pause", {"timeout_s": 10**30}),
        ("POST", "/admin/replicas/control", {"url": replica, "action": "pause", "body": {"n": 10**30}}),
        ("POST", "/admin/replicas/control", f'{{"url": "{replica}", "action": "pause", "params": {{"a": "\\ud800"}}}}'),
    ]
    with proxy_for([replica]) as proxy, httpx.Client(timeout=60) as http:
        for method, path, body in bad:
            text = body if isinstance(body, str) else json.dumps(body)
            answer = _send(http, method, proxy.url + path, text)
            assert answer.status_code == 400, (path, text[:80], answer.text[:300])
            assert set(answer.json()["error"]) == SHAPE
        # Nothing refused reached the pool or the active policy.
        assert [r["url"] for r in http.get(f"{proxy.url}/admin/replicas", headers=AUTH).json()["data"]] == [replica]
        assert http.get(f"{proxy.url}/admin/policy", headers=AUTH).json()["version"] != 2**31
        # The bounds themselves are stored.
        top = _send(http, "PUT", f"{proxy.url}/admin/policy", json.dumps({**policy, "version": 2**31 - 1,
                                                                         "base_model": "b" * 256}))
        assert top.status_code == 200 and top.json()["version"] == 2**31 - 1
        long_url = "http://" + "h" * 63 + "." + "h" * 63 + ":8000/" + "p" * (512 - 7 - 127 - 6)
        added = _send(http, "POST", f"{proxy.url}/admin/replicas", json.dumps({"url": long_url}))
        assert added.status_code == 201 and added.json()["url"] == long_url and len(long_url) == 512


# -- recorded JSON of any shape --------------------------------------------------------------------------------

# What an agent may send (the proxy records it as it came): each breaks an assumption of the conversation view.
ODD_CHATS: list[Any] = [
    [{"role": "assistant", "content": "x", "tool_calls": 5}],  # the case
    [{"role": "assistant", "content": None, "tool_calls": [XSS, 7]}],
    [{"role": "assistant", "tool_calls": [{"function": XSS}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": XSS, "arguments": {"a": [XSS]}}}]}],
    [{"role": "user", "content": {"nested": [XSS, {"deep": [1, 2, None]}]}}],
    [{"role": "user", "content": 12345678901234567890123456789}],  # past 64 bits
    [{"role": "user", "content": [1, None, True, {"text": {"a": XSS}}, [XSS]]}],
    [XSS, 5, None],
    5,
    XSS,
    {"role": "user", "content": XSS},
    [{"role": {"x": XSS}, "content": XSS}],
    [{"type": "function_call", "name": [XSS], "arguments": {"a": 1}}, {"type": "function_call_output", "output": 5}],
    [{"role": "user", "content": "fine"}, {"role": "assistant", "content": [{"text": XSS}], "tool_calls": {"a": XSS}}],
]
ODD_OTHERS: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"prompt": {"a": XSS}}),
    ("completions", {"prompt": [1, 2, XSS]}),
    ("responses", {"input": [5, {"type": "message", "content": 7}], "instructions": [XSS]}),
    ("responses", {"input": {"a": XSS}, "instructions": {"b": 1}}),
    ("messages", {"system": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": XSS}]}]}),
    ("messages", {"system": [XSS, 1], "messages": "x", "max_tokens": 4}),
]
# What a replica may answer, and token fields as recorded: these the proxy does not control either.
ODD_RESPONSES: list[Any] = [
    {"choices": 5}, {"choices": [XSS]}, {"choices": [{"message": XSS}]}, XSS, [1, XSS], 7, None,
    {"choices": [{"message": {"content": XSS, "tool_calls": 5}}]},
    {"choices": [{"message": {"content": {"a": XSS}}, "logprobs": {"content": [5, XSS]}}]},
    {"choices": [{"message": {"content": "ok"}, "logprobs": {"content": 5, "tokens": XSS}}]},
    {"choices": [{"message": {"content": "ok"}, "logprobs": {"content": [{"token": {"t": XSS}}]}}]},
    {"output": 5, "choices": [{"logprobs": 5}]},
]
ODD_TOKENS: list[dict[str, Any]] = [
    {"prompt_token_ids": [1, XSS], "completion_token_ids": [XSS, {"a": 1}], "completion_logprobs": [XSS, 1e308]},
    {"prompt_token_ids": [1, XSS, XSS, {"a": 1}, XSS], "completion_token_ids": [2],  # extends the one above
     "completion_logprobs": [10**400]},
    {"prompt_token_ids": XSS, "completion_token_ids": [3], "completion_logprobs": {"a": XSS}},
    {"prompt_token_ids": [], "completion_token_ids": [4, 5], "completion_logprobs": [1000.0, True]},
    {"prompt_token_ids": [1], "completion_token_ids": [6], "completion_logprobs": 5},
]


def _record_odd_calls(db_url: str, rollout_id: str) -> int:
    """Attempts whose call rows hold odd responses and token fields, written as the recorder writes rows."""
    now = dt.datetime.now(dt.UTC)
    rows: list[dict[str, Any]] = []
    for response in ODD_RESPONSES:
        rows.append({"response": response, "request": {"messages": [{"role": "user", "content": XSS}]}})
    for i, tokens in enumerate(ODD_TOKENS):
        rows.append({"attempt": "tokens", "seq": i, **tokens, "response": {"choices": [{"message": {"content": "ok"}}]},
                     "request": {"messages": [{"role": "user", "content": XSS}] * (i + 1)}})
    attempts = sorted({row.get("attempt", str(n)) for n, row in enumerate(rows)})
    engine = create_sync_db(DbSettings(url=db_url))
    try:
        with engine.begin() as conn:
            conn.execute(insert(Rollout).values(rollout_id=rollout_id))
            conn.execute(insert(Attempt), [{"rollout_id": rollout_id, "attempt_id": a, "status": "succeeded"}
                                           for a in attempts])
            # Every row with the same keys: an executemany takes its columns from the first row.
            conn.execute(insert(Call), [
                {"call_id": uuid4().hex, "rollout_id": rollout_id, "attempt_id": row.pop("attempt", str(n)),
                 "seq": row.pop("seq", 0), "route": "chat/completions", "is_streaming": False, "status": "ok",
                 "started_at": now, "ended_at": now, "prompt_token_ids": None, "completion_token_ids": None,
                 "completion_logprobs": None, **row} for n, row in enumerate(rows)])
    finally:
        engine.dispose()
    return len(attempts)


def _assert_renders(http: httpx.Client, url: str) -> str:
    page = http.get(url, headers=AUTH)
    assert page.status_code == 200, (url, page.text[:300])
    assert "<script>alert" not in page.text, url
    return page.text


def test_any_recorded_json_renders_escaped(proxy_for: ProxyFactory, replica: str, db_url: str) -> None:
    with proxy_for([replica]) as proxy, httpx.Client(timeout=60) as http:
        sent = [("chat/completions", {"messages": m}) for m in ODD_CHATS] + ODD_OTHERS
        for i, (route, body) in enumerate(sent):
            answer = http.post(f"{proxy.base_url('odd', str(i))}/{route}", json={"model": MODEL, **body})
            assert answer.status_code == 200, (route, body, answer.text[:300])
            http.post(f"{proxy.url}/rollout/odd/attempt/{i}/finish", json={"status": "succeeded"},
                      headers=AUTH).raise_for_status()
        for i in range(len(sent)):
            page = _assert_renders(http, f"{proxy.url}/ui/attempt/odd/{i}")
            assert XSS not in json.dumps(sent[i]) or ESCAPED in page, sent[i]
        # The case shows the request as it came, as JSON: nothing an agent sends is hidden.
        first = _assert_renders(http, f"{proxy.url}/ui/attempt/odd/0")
        assert "request (raw JSON)" in first and "&quot;tool_calls&quot;: 5" in first
        recorded = _record_odd_calls(db_url, "replica-odd")
        for attempt in [*map(str, range(len(ODD_RESPONSES))), "tokens"][:recorded]:
            page = _assert_renders(http, f"{proxy.url}/ui/attempt/replica-odd/{attempt}")
            assert ESCAPED in page
        tokens = _assert_renders(http, f"{proxy.url}/ui/attempt/replica-odd/tokens")
        assert 'class="tok masked" title="id &lt;script&gt;' in tokens  # the masked tokens between calls, escaped
        _assert_renders(http, f"{proxy.url}/ui?group=replica-odd")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.just(XSS),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["messages", "content", "tool_calls", "function", "choices", "message",
                                         "logprobs", "output", "input", "type", "text", "token", "role", "name"]),
                        inner, max_size=4), max_leaves=20)
ROUTES = st.sampled_from(["chat/completions", "completions", "messages", "responses", "embeddings"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(st.tuples(ROUTES, JSON, JSON, JSON, JSON, JSON), min_size=1, max_size=3))
def test_attempt_html_renders_any_json(calls: list[tuple[str, Any, Any, Any, Any, Any]]) -> None:
    attempt = {"rollout_id": "r", "attempt_id": "a", "group_id": "r", "status": "running", "policy_version": None,
               "rewards": [], "calls": [
                   {"call_id": f"c{i}", "seq": i, "route": route, "status": "ok", "policy_version": 0, "replica": "x",
                    "finish_reason": None, "request": request, "response": response, "prompt_token_ids": prompt,
                    "completion_token_ids": completion, "completion_logprobs": logprobs}
                   for i, (route, request, response, prompt, completion, logprobs) in enumerate(calls)]}
    page = ui.attempt_html(attempt, {})
    assert "<script>alert" not in page
    assert page.count("<section") == len(calls)


# -- sign-in: cookie flags and cross-site posts ----------------------------------------------------------------

def _sign_in(url: str, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    with httpx.Client(timeout=60, **kwargs) as http:
        return http.post(f"{url}/ui/login", data={"token": "t"}, headers=headers or {}, follow_redirects=False)


def _cookie(answer: httpx.Response) -> set[str]:
    assert answer.status_code == 303, answer.text[:300]
    return {part.strip().lower() for part in answer.headers["set-cookie"].split(";")[1:]}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_cookie_is_secure_over_https_only(proxy_for: ProxyFactory, replica: str) -> None:
    https = {"x-forwarded-proto": "https"}
    with proxy_for([replica]) as proxy:  # no trusted proxies: nobody's X-Forwarded-Proto counts
        plain = _cookie(_sign_in(proxy.url))
        assert {"httponly", "samesite=strict", "path=/ui"} <= plain and "secure" not in plain
        assert "secure" not in _cookie(_sign_in(proxy.url, https))
    with proxy_for([replica], trusted_proxies=["10.0.0.0/8"]) as proxy:  # a peer outside the list
        assert "secure" not in _cookie(_sign_in(proxy.url, https))
    with proxy_for([replica], trusted_proxies=["127.0.0.0/8", "::1"]) as proxy:
        assert {"secure", "httponly", "samesite=strict"} <= _cookie(_sign_in(proxy.url, https))
        assert "secure" in _cookie(_sign_in(proxy.url, {"x-forwarded-proto": "http, https"}))  # the peer's own value
        assert "secure" not in _cookie(_sign_in(proxy.url, {"x-forwarded-proto": "http"}))
        assert "secure" not in _cookie(_sign_in(proxy.url))


@contextmanager
def _tls_files(directory: Path) -> Iterator[tuple[str, str]]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(hours=1)).sign(key, hashes.SHA256()))
    (directory / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    yield str(directory / "key.pem"), str(directory / "cert.pem")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_cookie_is_secure_when_served_over_tls(db_url: str, replica: str, tmp_path: Path) -> None:
    settings = make_settings(db_url, [replica], tmp_path)
    app = create_app(settings)
    config = server_config(app, settings, port=free_port())
    with _tls_files(tmp_path) as (key, cert):
        config.ssl_keyfile, config.ssl_certfile = key, cert
        with serve_in_thread(app, config=config):
            url = f"https://127.0.0.1:{config.port}"
            assert {"secure", "httponly", "samesite=strict"} <= _cookie(_sign_in(url, verify=False))
            same = {"origin": url, "sec-fetch-site": "same-origin"}
            assert "secure" in _cookie(_sign_in(url, same, verify=False))
            # The same host over plain HTTP is another origin.
            assert _sign_in(url, {"origin": f"http://127.0.0.1:{config.port}"}, verify=False).status_code == 403


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_cross_site_sign_in_is_refused(proxy_for: ProxyFactory, replica: str) -> None:
    with proxy_for([replica], open_access=False) as proxy:
        port = proxy.url.rsplit(":", 1)[1]
        own = proxy.url
        for headers in ({"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-site"},
                        {"sec-fetch-site": "cross-site", "origin": own},  # a browser's own word wins
                        {"origin": "http://evil.example"}, {"origin": "null"}, {"origin": f"http://127.0.0.1:{int(port) + 1}"},
                        {"origin": f"https://127.0.0.1:{port}"}, {"origin": f"http://user@127.0.0.1:{port}"},
                        {"origin": "http://evil.example", "sec-fetch-site": "same-origin"},
                        {"origin": "http://dash.example", "x-forwarded-host": "dash.example"}):  # not trusted
            refused = _sign_in(proxy.url, headers)
            assert refused.status_code == 403, headers
            assert "set-cookie" not in refused.headers and "<h1>403</h1>" in refused.text
        for headers in ({}, {"sec-fetch-site": "same-origin"}, {"sec-fetch-site": "none"},
                        {"origin": own, "sec-fetch-site": "same-origin"}, {"origin": own.upper().replace("HTTP", "http")},
                        {"origin": f"http://localhost:{port}", "host": f"localhost:{port}"}):
            assert _sign_in(proxy.url, headers).status_code == 303, headers
        # A wrong token from this origin is still a 401, not a 403.
        with httpx.Client(timeout=60) as http:
            wrong = http.post(f"{proxy.url}/ui/login", data={"token": "nope"}, headers={"origin": own})
            assert wrong.status_code == 401
    with proxy_for([replica], trusted_proxies=["127.0.0.1"]) as proxy:
        behind = {"x-forwarded-proto": "https", "x-forwarded-host": "dash.example"}
        accepted = _sign_in(proxy.url, {**behind, "origin": "https://dash.example", "sec-fetch-site": "same-origin"})
        assert "secure" in _cookie(accepted)
        assert _sign_in(proxy.url, {**behind, "origin": "https://dash.example:443"}).status_code == 303
        assert _sign_in(proxy.url, {**behind, "origin": proxy.url}).status_code == 403  # not the client's origin
        assert _sign_in(proxy.url, {**behind, "origin": "http://dash.example"}).status_code == 403

