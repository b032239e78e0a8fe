"""The replica's chat template for the calculator agent: ChatML, the tools in the system turn, and
an assistant's tool call rendered as exactly the text the model wrote for it.

Why a template of our own: the first turn names the tool (`tool_choice="add"`), so the replica
constrains the model to the tool's arguments and the model writes only them, `{"a": 12, "b": 30}`
(no free whitespace: the replica runs with `disable_any_whitespace`, and `REPLICA_ENV` below).
vLLM parses the arguments back into a dict before rendering the next turn; `tojson` writes them
back with the same separators, which puts the model's own tokens into the next prompt (when it
tokenises them as the tokenizer would), so the trainer merges the episode's calls into one row (the tool's answer
between them masked out). A template that wrapped the call (`<tool_call>{"name": ...}`) would
give every turn a row of its own. SmolLM2-Instruct and the tests' tiny model share ChatML's
`<|im_start|>` / `<|im_end|>` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["REPLICA_ENV", "SEPARATORS", "TEMPLATE", "replica_args", "write_template"]

# vLLM's default for a named tool choice with the hermes parser is a structural tag: the model
# writes `<tool_call>{"name": ..., "arguments": ...}</tool_call>` with free whitespace inside,
# which no template can render back token for token. Off, the replica constrains the output to
# the tool's JSON schema alone, compact under `disable_any_whitespace`.
REPLICA_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}

TEMPLATE = (
    "{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + (messages[0]['content'] if has_system else 'You are a helpful assistant.') -}}"
    "{%- if tools -%}{{- '\\n\\nTools:' -}}"
    "{%- for tool in tools -%}{{- '\\n' + ((tool['function'] if tool['function'] is defined else tool) | tojson) -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in messages -%}"
    "{%- if not (loop.first and has_system) -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}"
    "{%- else -%}{{- fn['arguments'] | tojson(separators=SEPARATORS) -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{- message['content'] or '' -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# The separators each backend writes JSON with when it may not add whitespace (measured: xgrammar
# 0.2 `{"a": 1, "b": 2}`, llguidance 1.7 `{"a":1,"b":2}`).
SEPARATORS = {"xgrammar": "(', ', ': ')", "guidance": "(',', ':')"}


def write_template(folder: Path, backend: str = "xgrammar") -> Path:
    """Write the template for `backend` where a replica can read it; returns the file."""
    path = folder / "calculator-template.jinja"
    path.write_text(TEMPLATE.replace("SEPARATORS", SEPARATORS[backend]))
    return path


def replica_args(folder: Path, backend: str = "xgrammar") -> list[str]:
    """vLLM flags for a replica serving the calculator agent (the tool parser is tools.replica's).
    `backend`: the structured-output engine that constrains the forced call (xgrammar or guidance,
    the two that honour `disable_any_whitespace`)."""
    config = json.dumps({"backend": backend, "disable_any_whitespace": True})
    return ["--chat-template", str(write_template(folder, backend)), "--structured-outputs-config", config]
