"""The tokenizer of record encodes the cache: ``python -m ftlib.data build`` gives exactly the ids of
``tokenizers`` itself, whatever the text (letters newer than Python's Unicode database, one word of a
megabyte) and whatever lies in ftlib's own cache directory.

Each case builds a chat cache (ChatML) through the command line, as a user would, and compares every
document's ids with ``Tokenizer.encode(rendered conversation, add_special_tokens=False)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from ftlib.data import open_cache

ROOT = Path(__file__).resolve().parents[2]

# letters added in Unicode 15 (Nag Mundari, CJK extension H, Kawi), before a contraction: a letter class
# taken from an older Unicode database than the tokenizer's splits them off differently
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
UNICODE15 = ["\U0001e4d0's", "\U00031350's and more", "\U00011f04's", "a\U0001e4d0\U0001e4d1b's"]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE with Llama-3's pre-tokenizer whose merges span the pieces a pre-tokenizer cuts
    apart (``'s``, ``X'`` for a new letter X): a different split then shows in the ids."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = ["it's the cat's hat", "hello world, it's 42.", "the quick brown fox", *UNICODE15,
              "\U0001e4d0' \U00031350' \U00011f04' x's"]
    tok.train_from_iterator(corpus * 50, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _build(tmp_path: Path, tokenizer, texts: list[str], cache_root: Path, timeout: float = 600):
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Say it."},
                                                     {"role": "assistant", "content": t}]}) + "\n"
                           for t in texts), encoding="utf-8")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir(exist_ok=True)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    out = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(ROOT), FTLIB_CACHE_DIR=str(cache_root))
    r = subprocess.run([sys.executable, "-m", "ftlib.data", "build", "--source", str(src), "--tokenizer",
                        str(tok_dir / "tokenizer.json"), "--out", str(out), "--kind", "chat", "--chat-template",
                        "chatml", "--num-proc", "1", "--no-progress"],
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return open_cache(str(out))


def _assert_tokenizers_ids(cache, tokenizer, texts):
    assert len(cache) == len(texts)
    for i, t in enumerate(texts):
        chat = f"<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\n{t}<|im_end|>\n"
        want = tokenizer.encode(chat, add_special_tokens=False).ids
        got = cache[i][0].tolist()
        assert got == want, f"record {i} {t[:40]!r}: cache {got[:20]} vs tokenizers {want[:20]}"


def test_build_encodes_unicode15_letters_as_tokenizers_does(tmp_path, tokenizer):
    """Letters newer than Python's Unicode database get the ids ``tokenizers`` gives them (its own
    character classes), not ids from a second encoder's tables."""
    cache = _build(tmp_path, tokenizer, UNICODE15, tmp_path / "ftlib-cache")
    _assert_tokenizers_ids(cache, tokenizer, UNICODE15)


def test_build_ids_do_not_depend_on_files_in_ftlibs_cache_dir(tmp_path, tokenizer):
    """Damaged files under ``$FTLIB_CACHE_DIR`` (here: a same-size garbage character-class table where the
    earlier C++ encoder kept one, every code point a digit) cannot change the ids: the build encodes with
    ``tokenizers``."""
    import unicodedata

    root = tmp_path / "ftlib-cache"
    (root / "unicode").mkdir(parents=True)
    junk = np.full(0x110000, 2, np.uint8)  # every code point a "number": words cut into 3-character runs
    junk.tofile(root / "unicode" / f"classes-{unicodedata.unidata_version}.bin")
    texts = ["hello world, it's 42.", "the quick  brown\tfox!", "café über", *UNICODE15]
    cache = _build(tmp_path, tokenizer, texts, root)
    _assert_tokenizers_ids(cache, tokenizer, texts)


def test_build_of_one_megabyte_word_finishes_with_tokenizers_ids(tmp_path, tokenizer):
    """One 1 MB word without spaces (run-together words, as in minified text or a URL dump) builds in
    the tokenizer's own time (~2 s; an encoder quadratic in the word length took > 150 s) and gets its
    ids. The timeout is a guard against a hang, not a timing assertion."""
    rng = np.random.default_rng(0)
    parts = ["hello", "world", "the", "quick", "brown", "fox", "cat", "hat", "it"]  # merged tokens, no spaces
    word = "".join(rng.choice(parts, 1 << 19).tolist())[: 1 << 20]
    cache = _build(tmp_path, tokenizer, [word, "a short one"], tmp_path / "ftlib-cache", timeout=120)
    _assert_tokenizers_ids(cache, tokenizer, [word, "a short one"])


def test_the_removed_encoder_switch_is_reported_not_ignored(monkeypatch):
    from ftlib.data import FormatConfig, Formatter

    tok = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    monkeypatch.setenv("FTLIB_BPE_BACKEND", "cpp")
    with pytest.warns(UserWarning, match="FTLIB_BPE_BACKEND is no longer read"):
        Formatter(tok, FormatConfig(kind="text", add_eos=False))
