"""Exact JSON: parsing what any client or model can send, and storing it on either database.

A call is kept twice (`docs/recording.md`): its bytes exactly as they crossed the wire
(`calls.request_body`, `calls.response_body`), and a parsed, queryable copy in the JSON
columns. PostgreSQL's JSONB cannot hold every JSON value: it rejects U+0000 in a string,
and no database driver can encode a lone surrogate (`"\\ud800"`, which JSON allows as an
escape and vLLM accepts). `db_safe` makes the queryable copy storable (U+0000 and lone
surrogates become U+FFFD, non-finite numbers null) and says whether it had to change
anything; when it did, `dumps_exact` keeps the exact values as ASCII JSON text beside it
(`calls.json_exact`), and readers overlay them (`overlay_exact`).

This module must stay free of web and database imports: the proxy and the trainer use it.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import orjson

__all__ = [
    "ExactJsonError",
    "WideNumber",
    "db_safe",
    "db_safe_text",
    "MAX_DEPTH",
    "depth_of",
    "dumps_exact",
    "dumps_keys",
    "loads_exact",
    "overlay_exact",
]

# U+0000 (JSONB rejects it) and lone surrogates (no UTF-8 encoding exists for them).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_REPLACEMENT = "\ufffd"


class ExactJsonError(ValueError):
    """The bytes are not JSON (nor the relaxed JSON vLLM accepts)."""


class WideNumber(float):
    """A JSON number float64 cannot hold (`1e400`): its value is +-inf, and its text is kept so
    that it is written back as the client wrote it (orjson refuses float subclasses, so such a
    value always takes the stdlib path below)."""

    text: str

    def __new__(cls, text: str) -> WideNumber:
        number = super().__new__(cls, text)
        number.text = text
        return number


def _parse_float(text: str) -> float:
    number = float(text)
    return WideNumber(text) if math.isinf(number) else number


# A string no client sends by chance marks where a wide number's literal goes back in.
_PLACEHOLDER = "\x00rolltap-wide-number-" + os.urandom(8).hex() + "-"


def _no_constants(name: str) -> Any:
    # NaN and Infinity literals are not JSON; orjson refuses them too.
    raise ExactJsonError(f"{name} is not valid JSON")


def loads_exact(raw: bytes | str) -> Any:
    """Parse JSON, keeping what orjson refuses but JSON allows: lone surrogate escapes, numbers
    outside float64 (integers stay exact, a float beyond it a `WideNumber`), nesting deeper
    than orjson's limit. orjson first (fast); the stdlib only when orjson says no."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as first:
        try:
            # `json.loads(bytes)` decodes strict UTF-8 (invalid bytes are an error, as they should be).
            return json.loads(raw, parse_float=_parse_float, parse_constant=_no_constants)
        except (ValueError, RecursionError, UnicodeDecodeError) as exc:
            raise ExactJsonError(str(first)) from exc


def dumps_exact(value: Any) -> bytes:
    """JSON bytes for any value `loads_exact` returns; ASCII (escapes) when orjson cannot write it.
    `ExactJsonError` for nesting deeper than the stdlib can write (about 900 levels)."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        # Lone surrogates, integers beyond 64 bits, wide numbers, nesting deeper than orjson writes.
        literals: list[str] = []
        try:
            text = json.dumps(_mark_wide(value, literals), ensure_ascii=True, separators=(",", ":"), allow_nan=False)
        except RecursionError as exc:  # orjson reads 1024 levels but writes 255; the stdlib ~900
            raise ExactJsonError("JSON nested too deeply to write") from exc
        for i, literal in enumerate(literals):
            text = text.replace(json.dumps(f"{_PLACEHOLDER}{i}"), literal, 1)
        return text.encode()


def _mark_wide(value: Any, literals: list[str]) -> Any:
    if isinstance(value, WideNumber):
        literals.append(value.text)
        return f"{_PLACEHOLDER}{len(literals) - 1}"
    # Plain loops, not comprehensions: a comprehension is a second stack frame per level.
    if isinstance(value, dict):
        marked: dict[Any, Any] = {}
        for k, v in value.items():
            marked[k] = _mark_wide(v, literals)
        return marked
    if isinstance(value, list):
        items = []
        for v in value:
            items.append(_mark_wide(v, literals))
        return items
    if isinstance(value, float) and not math.isfinite(value):
        return None  # not JSON; only a wide number (above) can make one
    return value


# Deepest nesting the proxy forwards and stores. orjson reads 1024 levels but writes 255;
# deeper values take the stdlib, whose recursion (about 1000 frames, shared with the server's
# own stack) needs this margin: a deeper body is refused with 400 and recorded as sent.
MAX_DEPTH = 512


def depth_of(value: Any) -> int:
    """How deeply lists and objects nest in `value` (iterative: no recursion limit here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def dumps_keys(value: Any) -> bytes:
    """orjson's encoding of `value`, keys that are not strings written as strings. Parsed JSON has only
    string keys: its encoding is tried first without the option, which costs a third more on a 2 KB answer."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def db_safe_text(value: str | None, max_len: int | None = None) -> str | None:
    """A string column's copy: storable on both databases and within the column's length."""
    if value is None:
        return None
    if _UNSTORABLE.search(value):
        value = _UNSTORABLE.sub(_REPLACEMENT, value)
    return value[:max_len] if max_len is not None else value


def db_safe(value: Any) -> tuple[Any, bool, bytes | None]:
    """The storable copy of a JSON value, whether it differs from `value`, and its orjson
    encoding when `value` itself was storable (so the writer need not encode it again).

    Cost: a value without U+0000, surrogates or non-finite floats is returned as it is after
    one orjson pass (the common case); only the others are walked.
    """
    if value is None:
        return None, False, None
    try:
        text = dumps_keys(value)
    except (TypeError, orjson.JSONEncodeError):
        walked = _walk(value)  # surrogates, wide numbers, or only nesting orjson will not write
        return walked, walked != value, None
    if b"\\u0000" not in text:
        # orjson writes a non-finite float as null; only `loads_exact`'s stdlib fallback makes
        # them, and its values with surrogates or wide integers take the walk below.
        return value, False, text
    walked = _walk(value)
    return walked, walked != value, None


def _walk(value: Any) -> Any:
    if isinstance(value, str):
        return _UNSTORABLE.sub(_REPLACEMENT, value) if _UNSTORABLE.search(value) else value
    if isinstance(value, dict):  # loops, not comprehensions: one stack frame per level (see MAX_DEPTH)
        walked: dict[Any, Any] = {}
        for k, v in value.items():
            walked[_walk(k) if isinstance(k, str) else k] = _walk(v)
        return walked
    if isinstance(value, list):
        items = []
        for v in value:
            items.append(_walk(v))
        return items
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def overlay_exact(json_exact: str | None, fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` (read from the queryable columns) with the exact values kept beside them, if any."""
    if json_exact is None:
        return fields
    exact = loads_exact(json_exact)
    return {**fields, **{k: v for k, v in exact.items() if k in fields}}
