"""Fixtures for the data tests: a tiny byte-level BPE tokenizer trained in-process."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            # Gemma, Phi-3 and a separator for head+tail truncation
            "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<|system|>",
            "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<sep>"]
CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "assistant says hi there",
          "user asks why the sky is blue", "because of Rayleigh scattering", "système über naïve café"]


@pytest.fixture(scope="session")
def tokenizer():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, tr)
    return tok


def _write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.fixture
def write_jsonl():
    return _write_jsonl
