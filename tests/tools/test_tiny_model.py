"""The offline tiny model: tokenizer round-trips ASCII, chat template renders, model loads.

No vLLM here; this only checks the directory that tools.tiny_model builds.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from tools.tiny_model import IM_END, MARKER_FILE, build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_tokenizer_round_trips_ascii(model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in ["Hello, world!  Two  spaces\n\nand 12345 don't.", string.printable]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # Every token decodes to ASCII: the byte alphabet is printable ASCII only.
    assert all(tok.decode([i]).isascii() for i in range(len(tok)))
    assert 100 < len(tok) <= 1000


def test_tokenizer_json_matches_transformers_loader(model_dir: Path) -> None:
    # transformers 5 rebuilds qwen2 tokenizers from code; IDs must equal tokenizer.json's.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "The cat reads a book today.\n\n  x = [1, 2]  # ok"
    assert raw.encode(text).ids == tok.encode(text, add_special_tokens=False)


def test_chat_template_renders_chatml(model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")
    assert tok.eos_token == IM_END and tok.pad_token == "<|endoftext|>"
    # Special tokens are single IDs, never split into bytes.
    assert len(tok.encode("<|im_start|><|im_end|>", add_special_tokens=False)) == 2


def test_model_loads_and_generates(model_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (128, 2, 2)
    assert cfg.num_key_value_heads == 1 and cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tok) and model.dtype == torch.float32
    ids = tok("The cat", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4 or IM_END in tok.decode(out[0])
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids(IM_END)


def test_build_is_deterministic_and_cached(model_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "again", seed=0)
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (other / name).read_bytes() == (model_dir / name).read_bytes()
    mtime = (other / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(other, seed=0) == other  # marker present: no rebuild
    assert (other / "model.safetensors").stat().st_mtime_ns == mtime
    build_tiny_model(other, seed=1)  # another seed: rebuilt with different weights
    assert json.loads((other / MARKER_FILE).read_text())["seed"] == 1
    weights = (other / "model.safetensors").read_bytes()
    assert weights != (model_dir / "model.safetensors").read_bytes()


def test_chat_template_renders_tools_in_the_hermes_convention(model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    rendered = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith('<|im_start|>system\nTools you may call:\n<tools>\n{"name": "add", "parameters": ')
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n'
            '<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n') in rendered
    # vLLM's hermes parser needs the markers as single tokens; they are not special (kept in decoded text).
    ids = tok.encode("<tool_call></tool_call>", add_special_tokens=False)
    assert len(ids) == 2 and tok.decode(ids, skip_special_tokens=True) == "<tool_call></tool_call>"
