"""Model folders for throughput runs at real model sizes, with nothing downloaded.

vLLM's `--load-format dummy` fills the weights at random, so a folder with a real model's
`config.json` runs at that model's speed: the same layers, heads, KV cache and vocabulary
(the LM head and the sampler over the whole vocabulary are a large part of a small model's
step). The dimensions below are the published ones of each model family's config.

The tokenizer is the tiny model's (tools.tiny_model: byte-level BPE, ChatML template) with its
vocabulary padded to the config's `vocab_size` by filler tokens (" w123"): a dummy model samples
every ID up to `vocab_size`, and each must decode to text, as a real tokenizer's would, so the
API server's detokenizer and the streamed chunks do the work they do with the real model.

CLI: ``python -m bench.shapes SHAPE OUT_DIR`` (shapes: see ``SHAPES``); then serve it with
``--load-format dummy``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tools.tiny_model import CHAT_TEMPLATE, IM_END, build_tokenizer

_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "use_sliding_window": False, "attention_dropout": 0.0}
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-1.5B(-Instruct)
    "qwen2.5-1.5b": {**_QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
    # Meta-Llama-3-8B(-Instruct)
    "llama3-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                  "tie_word_embeddings": False},
    # SmolLM2-135M(-Instruct)
    "smollm2-135m": {**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True},
}


def build(shape: str, out: Path) -> Path:
    """Write `config.json` and a tokenizer of exactly the config's vocabulary into `out`."""
    config = dict(SHAPES[shape])
    vocab_size = int(config["vocab_size"])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    tok_file = out / "tokenizer.json"
    spec = json.loads(tok_file.read_text())
    # Fillers go into the BPE model's own vocabulary, not the added tokens: the added-token
    # matcher runs over every prompt, and 150,000 entries there would slow each encode. The tool
    # call markers (added tokens after the BPE vocabulary) go: transformers rebuilds the vocabulary
    # from the BPE model and would leave their IDs as holes that decode to nothing.
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["special"]]
    taken = set(spec["model"]["vocab"].values()) | {t["id"] for t in spec["added_tokens"]}
    free = (i for i in range(vocab_size) if i not in taken)
    for i in free:
        spec["model"]["vocab"][f"\u0120w{i}"] = i  # Ġ is byte-level BPE's space: decodes to " w123"
    tok_file.write_text(json.dumps(spec, ensure_ascii=False))
    cfg_file = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    # A plain fast tokenizer from tokenizer.json whatever the model type (transformers would
    # otherwise rebuild a Llama tokenizer from code), with the ChatML template inlined.
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg.pop("extra_special_tokens", None)
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    cfg_file.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True))
    eos = int(tokenizer.convert_tokens_to_ids(IM_END))  # type: ignore[arg-type]
    config.update(eos_token_id=eos, bos_token_id=eos, torch_dtype="bfloat16", rolltap_shape=shape)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    print(build(args.shape, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
