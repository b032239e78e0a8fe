"""tools.gguf_model: Gemma's tokenizer rebuilt from a GGUF's ranked vocabulary.

transformers maps the GGUF architecture `gemma3` to no tokenizer converter and falls back to a
BPE without merges; `_gemma_tokenizer` recovers the merges from the ranks. A real GGUF is written
here (gguf's own writer) with a small vocabulary ranked as Gemma's is (score = -rank).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tools.gguf_model import GEMMA_CHAT_TEMPLATE, _gemma_tokenizer  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# Ranked as a BPE learns them: pieces first, then what they merge into (merge order decides: "ca"
# ranks after "ital", so inside "capital" the "it" merge wins and no "pi" forms).
RANKED = ["▁", "a", "c", "i", "l", "p", "t", "1", "2", "it", "al", "ital", "▁c", "▁ca", "▁cap", "▁capital",
          "ca", "pi"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def _write_gguf(path: Path) -> None:
    tokens = SPECIALS + RANKED + BYTES
    scores = [-1000.0] * len(SPECIALS) + [-float(100 + i) for i in range(len(RANKED))] + [0.0] * len(BYTES)
    types = [3] * len(SPECIALS) + [1] * len(RANKED) + [6] * len(BYTES)  # control, normal, byte
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf"
    _write_gguf(path)
    tok = _gemma_tokenizer(path)
    tok.chat_template = GEMMA_CHAT_TEMPLATE
    return tok


def test_words_merge_by_rank_not_into_characters(tokenizer) -> None:
    ids = tokenizer("capital capital")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["ca", "p", "ital", "▁capital"]
    assert tokenizer.decode(ids) == "capital capital"


def test_unknown_characters_fall_back_to_bytes(tokenizer) -> None:
    ids = tokenizer("a é")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", "▁", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(ids) == "a é"


def test_chat_format_and_end_of_turn(tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12"},
         {"role": "assistant", "content": "21"}, {"role": "user", "content": "1"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\n12<end_of_turn>\n<start_of_turn>model\n21<end_of_turn>\n"
                    "<start_of_turn>user\n1<end_of_turn>\n<start_of_turn>model\n")
    assert tokenizer.eos_token == "<end_of_turn>" and tokenizer.eos_token_id == SPECIALS.index("<end_of_turn>")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == SPECIALS.index("<bos>") and ids.count(SPECIALS.index("<start_of_turn>")) == 4
