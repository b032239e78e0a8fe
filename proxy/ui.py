"""The dashboard's HTML: server-rendered pages, every value escaped, charts as inline SVG.

No template engine and no build step: f-strings over `html.escape`d values, one small
stylesheet and script under `proxy/static/`. The pages:
- the attempt list (filters, keyset "older" link),
- an attempt as a conversation with its token view: each call's generated tokens coloured
  by probability, the tokens between calls (tool results, user turns, template glue: the
  ones the trainer masks out of the loss) where a call extends the previous sequence,
  drop reasons, replica and policy version,
- per-version reward, entropy and staleness charts, and replica health and load.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any
from urllib.parse import urlencode

from proxy.balancer import ReplicaState

__all__ = ["attempt_html", "charts_html", "error_html", "list_html", "login_html"]

STATUSES = ("running", "succeeded", "failed", "cancelled")


def _e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def _page(title: str, body: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)} · Rolltap</title>'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<link rel="stylesheet" href="/ui/static/ui.css"></head><body>'
            '<nav><b>Rolltap</b> <a href="/ui">attempts</a> <a href="/ui/charts">training &amp; replicas</a></nav>'
            f'<main>{body}</main><script src="/ui/static/ui.js"></script></body></html>')


def login_html(message: str | None = None) -> str:
    note = f'<p class="error">{_e(message)}</p>' if message else ""
    return _page("sign in", f'<h1>Sign in</h1>{note}<p>The admin token, or an unscoped agent key.</p>'
                            '<form method="post" action="/ui/login"><input type="password" name="token" '
                            'autocomplete="current-password" required> <button>Open the dashboard</button></form>')


def error_html(status: int, message: str) -> str:
    return _page(f"error {status}", f'<h1>{status}</h1><p class="error">{_e(message)}</p>')


def _reward(value: Any) -> str:
    return "" if value is None else f"{float(value):.3g}"


def _time(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if hasattr(value, "strftime") else _e(value)


def list_html(rows: Sequence[dict[str, Any]], filters: dict[str, str], next_before: int | None,
              elapsed_ms: float) -> str:
    def field(name: str, label: str, kind: str = "text") -> str:
        return (f'<label>{label} <input type="{kind}" name="{name}" value="{_e(filters.get(name, ""))}" '
                f'{"step=any" if kind == "number" else ""}></label>')

    options = "".join(f'<option{" selected" if filters.get("status") == s else ""}>{s}</option>' for s in STATUSES)
    form = ('<form class="filters" method="get" action="/ui">'
            f'<label>status <select name="status"><option value="">any</option>{options}</select></label>'
            + field("group", "group") + field("version", "policy version", "number")
            + field("reward_min", "reward ≥", "number") + field("reward_max", "reward ≤", "number")
            + field("since", "since (UTC)", "datetime-local") + field("until", "until (UTC)", "datetime-local")
            + '<button>Filter</button> <a href="/ui">clear</a></form>')
    body = []
    for r in rows:
        link = f'/ui/attempt/{_e(r["rollout_id"])}/{_e(r["attempt_id"])}'
        body.append(f'<tr class="status-{_e(r["status"])}"><td><a href="{link}">{_e(r["rollout_id"])}/'
                    f'{_e(r["attempt_id"])}</a></td><td>{_e(r["group_id"])}</td><td>{_e(r["status"])}</td>'
                    f'<td class="num">{_e(r["policy_version"])}</td><td class="num reward">{_reward(r["reward"])}</td>'
                    f'<td class="num">{_e(r["num_calls"])}</td><td>{_time(r["created_at"])}</td></tr>')
    table = ('<table class="attempts"><thead><tr><th>attempt</th><th>group</th><th>status</th><th>version</th>'
             '<th>reward</th><th>calls</th><th>created</th></tr></thead><tbody>'
             + ("".join(body) or '<tr><td colspan="7">no attempts match</td></tr>') + "</tbody></table>")
    pager = ""
    if next_before is not None:
        query = urlencode({**{k: v for k, v in filters.items() if v}, "before": next_before})
        pager = f'<p><a class="older" href="/ui?{_e(query)}">older attempts →</a></p>'
    return _page("attempts", f'<h1>Attempts</h1>{form}{table}{pager}'
                             f'<p class="meta">{len(rows)} shown · page read in {elapsed_ms:.1f} ms</p>')


# -- an attempt --------------------------------------------------------------------------------------------

class _Unrecognized(Exception):
    """A recorded value of a shape the conversation view does not know: the call shows it as raw JSON.

    Recorded requests are what agents sent: an agent whose odd JSON (`"tool_calls": 5`) broke its
    attempt's page would hide that attempt from review.
    """


def _dict(value: Any) -> dict[str, Any]:
    """A JSON object; absent (None) is empty."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    raise _Unrecognized


def _list(value: Any) -> list[Any]:
    """A JSON array; absent (None) is empty."""
    if value is None:
        return []
    if isinstance(value, list):
        return value
    raise _Unrecognized


def _raw(value: Any) -> str:
    # The stdlib, not orjson: it writes integers past 64 bits, NaN and any depth orjson reads.
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return "".join(p if isinstance(p, str) else str(_dict(p).get("text") or p.get("output") or "")
                   for p in _list(content))


def _call_text(call: Any) -> str:
    function = _dict(_dict(call).get("function"))
    return f'\n→ {function.get("name")}({function.get("arguments")})'


def _turns(route: str, request: Any) -> list[tuple[str, str]]:
    """(role, text) of what a call sent, for any recorded route."""
    if request is None:
        return []
    request = _dict(request)
    if route == "completions":
        return [("prompt", _text(request.get("prompt")))]
    turns: list[tuple[str, str]] = []
    if route in ("messages", "responses"):
        system = request.get("system") or request.get("instructions")
        if system:
            turns.append(("system", _text(system)))
    items = request.get("messages") if route != "responses" else request.get("input")
    if isinstance(items, str):
        return [*turns, ("user", items)]
    for item in _list(items):
        item = _dict(item)
        kind = item.get("type")
        if kind == "function_call":
            turns.append(("assistant", f'→ {item.get("name")}({item.get("arguments")})'))
        elif kind == "function_call_output":
            turns.append(("tool", _text(item.get("output"))))
        else:
            text = _text(item.get("content")) + "".join(_call_text(c) for c in _list(item.get("tool_calls")))
            turns.append((str(item.get("role", "user")), text))
    return turns


def _reply(route: str, response: Any) -> str:
    if response is None:
        return ""
    response = _dict(response)
    if route == "responses":
        parts = []
        for item in _list(response.get("output")):
            item = _dict(item)
            if item.get("type") == "message":
                parts.append(_text(item.get("content")))
            elif item.get("type") == "function_call":
                parts.append(f'→ {item.get("name")}({item.get("arguments")})')
        return "\n".join(parts)
    if route == "messages":
        return _text(response.get("content"))
    choices = _list(response.get("choices"))
    choice = _dict(choices[0]) if choices else {}
    if route == "completions":
        return str(choice.get("text") or "")
    message = _dict(choice.get("message"))
    return _text(message.get("content")) + "".join(_call_text(c) for c in _list(message.get("tool_calls")))


def _token_texts(route: str, response: Any) -> list[str] | None:
    """The generated tokens' text as the replica reported it with their logprobs, where it did. Logprobs
    the proxy asked for on its own come as token IDs (`token_id:N`, vLLM's `return_tokens_as_token_ids`):
    no text, so the strip shows the IDs."""
    texts = _reported_texts(route, response)
    if not texts or any(_TOKEN_ID.fullmatch(text) for text in texts):
        return None
    return texts


_TOKEN_ID = re.compile(r"token_id:-?[0-9]+")


def _reported_texts(route: str, response: Any) -> list[str] | None:
    if not isinstance(response, dict):
        return None
    if route == "responses":
        return [str(_dict(e).get("token", "")) for item in _list(response.get("output"))
                if _dict(item).get("type") == "message"
                for part in _list(item.get("content")) for e in _list(_dict(part).get("logprobs"))]
    choices = _list(response.get("choices"))
    logprobs = _dict(choices[0]).get("logprobs") if choices else None
    if not isinstance(logprobs, dict):
        return None
    if route == "chat/completions":
        return [str(_dict(e).get("token", "")) for e in _list(logprobs.get("content"))]
    return [str(t) for t in _list(logprobs.get("tokens"))]


def _logprob(value: Any) -> float | None:
    """A recorded logprob as a float; None for anything else (a string, a bool, NaN, an integer past float's range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return None if math.isnan(number) else number


def _colour(logprob: float | None) -> str:
    # Probability 1 is green, 0 red, through yellow: hue 0..120.
    if logprob is None:
        return "hsl(0 0% 85%)"
    return f"hsl({120 * math.exp(min(0.0, logprob)):.0f} 70% 80%)"


def _tokens_html(ids: Sequence[Any], texts: Sequence[str] | None, logprobs: Any) -> str:
    spans = []
    for i, token in enumerate(ids):
        lp = _logprob(logprobs[i]) if isinstance(logprobs, list) and i < len(logprobs) else None
        text = texts[i] if texts is not None and len(texts) == len(ids) else f"#{token}"
        # min(0, lp): a logprob above 0 is no probability, and exp() of a large one overflows.
        tip = f"id {token}" + (f" · logprob {lp:.3f} · p {math.exp(min(0.0, lp)):.3f}" if lp is not None else "")
        spans.append(f'<span class="tok gen" style="background:{_colour(lp)}" title="{_e(tip)}">{_e(text)}</span>')
    return "".join(spans)


def _masked_html(ids: Sequence[Any]) -> str:
    return "".join(f'<span class="tok masked" title="id {_e(t)} · masked out of the loss">#{_e(t)}</span>'
                   for t in ids)


def _call_html(call: dict[str, Any], previous: list[int] | None, shown_turns: int,
               drop: tuple[str, str | None] | None) -> tuple[str, list[int] | None, int]:
    route = call["route"]
    try:
        turns = _turns(route, call["request"])
    except _Unrecognized:
        turns = [("request (raw JSON)", _raw(call["request"]))]
    new_turns = turns[shown_turns:] if shown_turns <= len(turns) else turns
    conversation = "".join(f'<div class="turn role-{_e(role)}"><span class="role">{_e(role)}</span>'
                           f'<pre>{_e(text)}</pre></div>' for role, text in new_turns)
    try:
        reply = _reply(route, call["response"])
    except _Unrecognized:
        reply = "response (raw JSON): " + _raw(call["response"])
    conversation += (f'<div class="turn role-assistant reply"><span class="role">assistant (generated)</span>'
                     f'<pre>{_e(reply)}</pre></div>')
    prompt, completion = call["prompt_token_ids"], call["completion_token_ids"]
    tokens = '<p class="meta">no token IDs recorded</p>'
    sequence = None
    if isinstance(prompt, list) and isinstance(completion, list):
        if previous is not None and prompt[:len(previous)] == previous:
            head = (f'<span class="merge" title="this call extends the previous sequence">merge point: '
                    f'{len(prompt) - len(previous)} tokens between calls, masked</span>'
                    + _masked_html(prompt[len(previous):]))
        else:
            head = f'<span class="merge new">new sequence: prompt of {len(prompt)} tokens</span>'
        try:
            texts = _token_texts(route, call["response"])
        except _Unrecognized:
            texts = None  # the ids stand in for the text
        tokens = f'<div class="tokens">{head}{_tokens_html(completion, texts, call["completion_logprobs"])}</div>'
        sequence = [*prompt, *completion]
    badges = [f'<span class="badge status-{_e(call["status"])}">{_e(call["status"])}</span>',
              f'<span class="badge">{_e(route)}</span>',
              f'<span class="badge">policy v{_e(call["policy_version"])}</span>',
              f'<span class="badge">replica {_e(call["replica"])}</span>']
    if call.get("finish_reason"):
        badges.append(f'<span class="badge">finish {_e(call["finish_reason"])}</span>')
    if drop is not None:
        badges.append(f'<span class="badge drop" title="{_e(drop[1])}">dropped: {_e(drop[0])}</span>')
    html = (f'<section class="call" id="{_e(call["call_id"])}"><h3>call {_e(call["seq"])} '
            f'{"".join(badges)}</h3><div class="conversation">{conversation}</div>{tokens}</section>')
    return html, sequence, len(turns) + 1


def attempt_html(attempt: dict[str, Any], drops: dict[str, tuple[str, str | None]]) -> str:
    rewards = "".join(f'<li><span class="reward">{_reward(r["value"])}</span> {_e(r.get("name") or "")}'
                      f'{" (call " + _e(r["call_id"]) + ")" if r.get("call_id") else ""}</li>'
                      for r in attempt["rewards"]) or "<li>none yet</li>"
    sections = []
    previous: list[int] | None = None
    shown = 0
    for call in attempt["calls"]:
        html, sequence, shown = _call_html(call, previous, shown, drops.get(call["call_id"]))
        sections.append(html)
        if sequence is not None and call["status"] == "ok":
            previous = sequence
    title = f'{attempt["rollout_id"]}/{attempt["attempt_id"]}'
    legend = ('<p class="legend"><span class="tok gen" style="background:hsl(120 70% 80%)">likely</span>'
              '<span class="tok gen" style="background:hsl(0 70% 80%)">unlikely</span> generated tokens '
              '(trained on), coloured by probability · <span class="tok masked">#id</span> tokens between calls '
              '(masked out of the loss) · hover a token for its id and logprob</p>')
    return _page(title, f'<h1>{_e(title)}</h1><p>group <b>{_e(attempt["group_id"])}</b> · status '
                        f'<b class="status-{_e(attempt["status"])}">{_e(attempt["status"])}</b> · policy version '
                        f'{_e(attempt["policy_version"])} · {len(attempt["calls"])} calls</p>'
                        f'<h2>Rewards</h2><ul class="rewards">{rewards}</ul>{legend}{"".join(sections)}')


# -- charts and replicas -----------------------------------------------------------------------------------

def _svg_chart(title: str, points: Sequence[tuple[int, float]]) -> str:
    width, height, pad = 360, 180, 32
    if not points:
        return f'<figure class="chart"><figcaption>{_e(title)}</figcaption><p class="meta">no data yet</p></figure>'
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def at(x: float, y: float) -> str:
        return (f"{pad + (x - x0) / (x1 - x0) * (width - 2 * pad):.1f},"
                f"{height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad):.1f}")

    line = " ".join(at(x, y) for x, y in points)
    dots = "".join(f'<circle cx="{at(x, y).split(",")[0]}" cy="{at(x, y).split(",")[1]}" r="3">'
                   f'<title>v{x}: {y:.4g}</title></circle>' for x, y in points)
    return (f'<figure class="chart"><figcaption>{_e(title)}</figcaption>'
            f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}">'
            f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" class="axis"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" class="axis"/>'
            f'<text x="{pad}" y="{height - 8}">v{x0}</text><text x="{width - pad}" y="{height - 8}" '
            f'text-anchor="end">v{max(xs)}</text><text x="4" y="{pad}">{y1:.3g}</text>'
            f'<text x="4" y="{height - pad}">{y0:.3g}</text>'
            f'<polyline points="{line}"/>{dots}</svg></figure>')


def _replicas_html(replicas: Iterable[ReplicaState]) -> str:
    rows = "".join(
        f'<tr><td>{_e(r.shown_url)}</td><td class="{"ok" if r.is_healthy else "bad"}">'
        f'{"healthy" if r.is_healthy else "down"}{" (draining)" if r.is_draining else ""}</td>'
        f'<td class="num">{r.in_flight}</td><td class="num">{r.running:g}</td><td class="num">{r.waiting:g}</td>'
        f'<td class="num">{100 * r.kv_usage:.0f}%</td><td class="num">{r.rollouts}</td><td>{_e(", ".join(r.models))}</td></tr>'
        for r in replicas)
    return ('<table class="replicas"><thead><tr><th>replica</th><th>health</th><th>in flight</th><th>running</th>'
            '<th>waiting</th><th>KV cache</th><th>rollouts</th><th>models</th></tr></thead><tbody>'
            + (rows or '<tr><td colspan="8">no replicas</td></tr>') + "</tbody></table>")


def charts_html(curves: dict[str, list[tuple[int, float]]], replicas: Iterable[ReplicaState]) -> str:
    charts = (_svg_chart("mean reward by policy version", curves.get("reward_mean", []))
              + _svg_chart("entropy by policy version", curves.get("entropy", []))
              + _svg_chart("staleness (max versions behind) by policy version", curves.get("staleness_max", [])))
    return _page("training & replicas", f'<h1>Training</h1><div class="charts">{charts}</div>'
                                        f'<h1>Replicas</h1>{_replicas_html(replicas)}')
