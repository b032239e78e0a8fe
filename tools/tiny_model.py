"""Build a tiny, fully offline Hugging Face model directory for tests and demos.

This module owns the one recipe for the "tiny model" every offline test uses: a
byte-level BPE tokenizer trained on built-in ASCII text, a ChatML chat template, and
a randomly initialised 2-layer Qwen2 model. Nothing is downloaded; the same seed
gives the same bytes, so token IDs recorded in one run are meaningful in the next.

CLI: ``python -m tools.tiny_model OUT_DIR [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay lazy: `import tools.tiny_model` must be cheap
    from transformers import PreTrainedTokenizerFast

# Bump when the recipe changes so stale directories are rebuilt, not reused.
RECIPE_VERSION = 4
MARKER_FILE = "rolltap_tiny_model.json"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# Hermes-style tool-call markers: plain added tokens (not special, so replicas keep them in the
# text their tool parser reads), one ID each, as vLLM's `hermes` parser requires.
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
VOCAB_SIZE = 400
# Copied from transformers' Qwen2Tokenizer (see build_tokenizer for why it must match).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, plus tools in the Hermes convention (what `--tool-call-parser hermes` reads back):
# the tool list goes into the system turn as JSON, an assistant's calls are `<tool_call>` blocks
# of `{"name", "arguments"}`, and tool results come back in a `tool` turn. Without tools every
# turn renders exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(skip_first=false) -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ messages[0]['content'] + '\n\n' }}{%- set ns.skip_first = true -%}"
    "{%- endif -%}"
    "{{ 'Tools you may call:\n<tools>\n' }}"
    "{%- for tool in tools -%}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}"
    "{{ '\n' }}{%- endfor -%}"
    "{{ '</tools>\nTo call one, answer <tool_call>\n{\"name\": NAME, \"arguments\": {...}}\n"
    "</tool_call><|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (loop.first and ns.skip_first) -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<tool_response>\n' + (message['content'] or '') + '\n</tool_response>' }}"
    "{%- else -%}{{ message['content'] or '' }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{ '<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "{{ '}\n</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

# Sentence parts for the synthetic corpus; "|" separates entries.
_SUBJECTS = (
    "the cat|a dog|the model|my friend|the user|an agent|the server|a student|the teacher|our team"
).split("|")
_VERBS = "reads|writes|sees|likes|answers|finds|checks|builds|tests|sends".split("|")
_OBJECTS = (
    "a book|the code|a short note|the answer|some numbers|"
    "a new idea|the tokens|a simple plan|the question|a reply"
).split("|")
_TAILS = (
    "today.|again.|very fast.|with care.|at night.|"
    "in the morning.|for the test.|one more time.|without errors.|and smiles."
).split("|")
_EXTRA = [
    "What is 7 + 5? The answer is 12.",
    "Hello! How are you? I am fine, thank you.",
    "Please add 2 and 3, then multiply by 4: (2 + 3) * 4 = 20.",
    "def add(a, b):\n    return a + b",
    "x = [1, 2, 3]; y = {'k': \"v\"}; print(x, y)",
    "Email: user@example.com, path: /tmp/file_01.txt, cost: $3.50 (50% off)!",
    "Use <tags>, back\\slash, `code`, ~tilde, ^caret, |pipe| and #hash & more.",
    "system: you are a helpful assistant. user: hi. assistant: hello.",
]


def training_text() -> list[str]:
    """A few hundred lines of deterministic ASCII English (no external corpus)."""
    lines: list[str] = []
    # Stepping through the word lists with co-prime strides gives varied sentences
    # without any randomness, so the BPE merges are stable across runs.
    for i in range(300):
        s = _SUBJECTS[i % 10].capitalize()
        verb, obj, tail = _VERBS[(i * 3) % 10], _OBJECTS[(i * 7) % 10], _TAILS[(i // 10) % 10]
        lines.append(f"{s} {verb} {obj} {tail}")
    lines.extend(_EXTRA * 5)
    lines.append(string.printable)  # every printable ASCII byte is seen at least once
    return lines


def _ascii_alphabet() -> list[str]:
    """Byte-level symbols for printable ASCII only.

    Restricting the initial alphabet (instead of all 256 bytes) means every token in
    the vocabulary decodes to ASCII, so decoded text never contains U+FFFD halves.
    """
    from tokenizers.pre_tokenizers import ByteLevel

    full = ByteLevel.alphabet()
    # Byte-level BPE maps each byte to a printable unicode char; recover that mapping
    # by pre-tokenising each ASCII char on its own.
    pre = ByteLevel(add_prefix_space=False, use_regex=False)
    chars = {pre.pre_tokenize_str(c)[0][0] for c in string.printable}
    assert chars <= set(full)
    return sorted(chars)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on ``training_text()`` and wrap it for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # The pipeline is exactly Qwen2's: transformers 5 loads any model_type=qwen2
    # tokenizer through Qwen2Tokenizer, which rebuilds the normalizer and
    # pre-tokenizer from code. Matching it keeps token IDs identical whether the
    # directory is read by vLLM, transformers 5, or transformers 4 (tokenizer.json).
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=_ascii_alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,  # chat turns end with <|im_end|>, so generation stops there
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens([TOOL_CALL_START, TOOL_CALL_END])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _widen_tokenizer_config(path: Path) -> None:
    """Make the saved tokenizer config loadable by transformers 4.x as well as 5.x.

    transformers 5 writes ``TokenizersBackend`` and a list-valued
    ``extra_special_tokens``, which 4.x (pinned by some trainer stacks) rejects; the
    4.x spelling is still understood by 5.x. The template is also inlined because
    older 4.x releases ignore ``chat_template.jinja``.
    """
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _is_complete(out_dir: Path, seed: int) -> bool:
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(meta.get("seed") == seed and meta.get("recipe_version") == RECIPE_VERSION)


def build_tiny_model(out_dir: Path, *, seed: int = 0) -> Path:
    """Build (or reuse) the tiny model in ``out_dir`` and return its path.

    Reuse happens only when the marker file (written last) records the same seed and
    recipe version, so a half-written directory from a crashed build is rebuilt.
    """
    out_dir = Path(out_dir)
    if _is_complete(out_dir, seed):
        return out_dir

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    eos_id = int(tokenizer.convert_tokens_to_ids(IM_END))  # type: ignore[arg-type]
    pad_id = int(tokenizer.convert_tokens_to_ids(ENDOFTEXT))  # type: ignore[arg-type]
    config = Qwen2Config(
        vocab_size=len(tokenizer),  # exact: vLLM must never sample an ID the tokenizer lacks
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: vLLM's CPU attention rejects small head dims
        num_key_value_heads=1,
        intermediate_size=256,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_sliding_window=False,
        # With the default 0.02 the residual stream is dominated by the (tied) input
        # embedding and greedy decoding repeats one token forever; 0.2 gives varied,
        # peaked output, which makes token/text alignment tests meaningful.
        initializer_range=0.2,
    )
    config.dtype = "float32"
    # Seed only a private generator state: callers' global RNG stays untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.float()  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )

    # Build next to the target and move into place, so readers never see a partial dir.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _widen_tokenizer_config(tmp / "tokenizer_config.json")
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; other users (a server, CI) must read it
    (tmp / MARKER_FILE).write_text(json.dumps({"seed": seed, "recipe_version": RECIPE_VERSION}))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
