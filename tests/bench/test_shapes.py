"""bench.shapes: a model folder of a real model's dims whose tokenizer covers every ID the model samples."""

import json
from pathlib import Path

from bench.shapes import SHAPES, build


def test_tokenizer_covers_the_configs_vocabulary(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = build("qwen2.5-1.5b", tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 1536 and config["vocab_size"] == SHAPES["qwen2.5-1.5b"]["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.decode([config["vocab_size"] - 1]) == f" w{config['vocab_size'] - 1}"
    assert tokenizer.convert_ids_to_tokens(config["eos_token_id"]) == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt
