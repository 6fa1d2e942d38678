"""ftlib.data.fast_bpe against tokenizers: the same ids and character offsets, or Unsupported.

Invariant: for every text t, ``FastBPE(tok).encode_batch([t])`` == ``tok.encode(t,
add_special_tokens=False)`` in ids and offsets, for GPT-2's ByteLevel pre-tokenizer and the Llama-3
(with ``ignore_merges``) and Qwen2 (NFC) Split patterns. Texts are drawn from pieces that hit each
branch of the patterns: contractions in both cases, runs of letters / digits / punctuation, every kind
of white space (incl. the ones only Unicode calls space), line breaks before and after spaces,
multi-byte characters split across tokens, and added tokens inside words.
"""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ftlib.data import FormatConfig, Formatter, SkipReport
from ftlib.data.fast_bpe import LLAMA3_PATTERN, QWEN2_PATTERN, FastBPE, Unsupported, fast_bpe_for

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im", "x<|im"]  # the last two: added, normalized
PIECES = (["a", "b", "x", "e", "s", "t", "l", "ll", "re", "ve", "d", "m", "S", "T", "LL", "RE", "hello", "world", "The",
           "'", "'s", "'S", "'t", "'re", "'Ve", "'LL", "'d", "'M", "'x", "'ſ", "ſ", "\u212a",
           "0", "1", "42", "1234567", "\u0663", "\u00bd", "\u2167",
           " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n", "\n ", "\u00a0", "\u3000", "\u2028", "\x0b",
           "\x1c", "\x85", "\u200b",
           ".", ",", "!?", "(", ")", "-", "...", "/*", "\"", "#",
           "é", "e\u0301", "ß", "漢字", "日本", "😀", "👍🏽", "\u0410\u0411", "\u05d0", "\ud7ff", "\U0001f600\U0001f601"]
          + SPECIALS)
text_st = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)
any_text_st = st.text(st.characters(exclude_categories=("Cs",)), max_size=60)


def _corpus():
    rng = np.random.default_rng(0)
    words = [p for p in PIECES if p not in SPECIALS]
    for _ in range(3000):
        yield "".join(rng.choice(words, rng.integers(1, 30)).tolist())
    for _ in range(500):
        yield " ".join(["the quick brown fox", "it's", "they'll", "DON'T", "12345", "naïve café", "日本語"])


def _train(pre, normalizer=None, ignore_merges=False, vocab=700):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS[:3],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
    # normalized added tokens, matched only between the raw-text ones: "<|im" is a prefix of two special
    # tokens, "x<|im" overlaps them from the left ("x<|im_end|>" is "x" + "<|im_end|>", not "x<|im" + ...)
    tok.add_tokens(SPECIALS[3:])
    return tok


def _split(pattern):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@pytest.fixture(scope="module", params=["gpt2", "llama3", "qwen2"])
def pair(request):
    if request.param == "gpt2":
        tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False))
    elif request.param == "llama3":
        tok = _train(_split(LLAMA3_PATTERN), ignore_merges=True)
    else:
        tok = _train(_split(QWEN2_PATTERN), normalizer=normalizers.NFC())
    return tok, FastBPE.from_tokenizer(tok)


def _check(tok, fast, texts):
    got = fast.encode_batch(texts)
    encs = tok.encode_batch(texts, add_special_tokens=False)
    if got is None:  # only for a text that NFC would change
        assert fast.nfc and any(t != __import__("unicodedata").normalize("NFC", t) for t in texts)
        return
    ids, offs, counts = got
    assert counts.tolist() == [len(e.ids) for e in encs]
    k = 0
    for t, e, n in zip(texts, encs, counts.tolist()):
        assert ids[k:k + n].tolist() == e.ids, (t, e.tokens)
        assert [tuple(o) for o in offs[k:k + n].tolist()] == [tuple(o) for o in e.offsets], (t, e.tokens)
        k += n


@settings(max_examples=300, deadline=None)
@given(st.lists(text_st, min_size=1, max_size=6))
def test_ids_and_offsets_equal_tokenizers(pair, texts):
    _check(*pair, texts)


@settings(max_examples=150, deadline=None)
@given(st.lists(any_text_st, min_size=1, max_size=4))
def test_any_unicode_text(pair, texts):
    _check(*pair, texts)


def test_edges(pair):
    _check(*pair, ["", " ", "\n", "a", "<|im_start|>", "<|im_start|><|im_end|>", "<|im", "x<|im_endx",
                   "  \n  ", "a  ", "it's  IT'S 'll", "1234567 ", "😀" * 20, " " * 300 + "x", "é" * 50])


def test_cache_is_consistent_across_batches(pair):
    tok, fast = pair
    texts = ["hello world it's", "world hello", "hello"]
    for _ in range(3):  # the second and third calls read the per-pre-token cache
        _check(tok, fast, texts)


def test_long_batch_matches(pair):
    rng = np.random.default_rng(1)
    texts = ["".join(rng.choice(PIECES, rng.integers(0, 200)).tolist()) for _ in range(300)]
    _check(*pair, texts)


@pytest.mark.parametrize("change,part", [
    (lambda j: j.update(model={**j["model"], "type": "WordPiece"}), "model"),
    (lambda j: j["pre_tokenizer"].update(add_prefix_space=True), "pre-tokenizer"),
    (lambda j: j.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}), "Split"),
    (lambda j: j.update(normalizer={"type": "Lowercase"}), "normalizer"),
    (lambda j: j.update(post_processor={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                        "use_regex": True}), "post-processor"),
    (lambda j: j["added_tokens"][1].update(lstrip=True), "lstrip"),
    (lambda j: j["model"].update(dropout=0.1), "dropout"),
])
def test_unsupported_parts_are_named(change, part):
    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), vocab=300)
    spec = json.loads(tok.to_str())
    change(spec)
    with pytest.raises(Unsupported, match=part):
        FastBPE(spec)
    assert fast_bpe_for(tok) is not None
    assert fast_bpe_for(tok, "tokenizers") is None
    try:
        bad = Tokenizer.from_str(json.dumps(spec))
    except Exception:  # a spec tokenizers itself refuses (WordPiece with BPE's fields)
        return
    assert fast_bpe_for(bad) is None
    with pytest.raises(Unsupported, match=part):
        fast_bpe_for(bad, "cpp")


def test_formatter_documents_equal_with_and_without_fast_path():
    """The cache's formatter: documents and masks through FastBPE equal those through tokenizers."""
    tok = _train(_split(LLAMA3_PATTERN), ignore_merges=True)
    rng = np.random.default_rng(2)
    words = [p for p in PIECES if p not in SPECIALS]
    recs = []
    for i in range(60):
        msgs = [{"role": r, "content": "".join(rng.choice(words, rng.integers(1, 25)).tolist())}
                for r in ["system", "user", "assistant", "user", "assistant"][: int(rng.integers(3, 6))]]
        recs.append(({"messages": msgs}, f"r{i}"))
    outs = []
    for fast in (True, False):
        fmt = Formatter(tok, FormatConfig(kind="chat", chat_template="chatml"))
        if not fast:
            fmt._fast = False
        outs.append(fmt.format_batch(iter(recs), SkipReport(strict=False)))
        assert (fmt._fast is not False) == fast
    for (w1, d1), (w2, d2) in zip(*outs):
        assert w1 == w2 and (d1 is None) == (d2 is None)
        if d1 is not None:
            assert np.array_equal(d1.input_ids, d2.input_ids) and np.array_equal(d1.loss_mask, d2.loss_mask)
            assert d1.input_ids.dtype == d2.input_ids.dtype
    assert sum(d is not None for _, d in outs[0]) > 50


def test_threads_share_one_encoder(pair):
    """ctypes releases the GIL during the call: concurrent calls on one encoder must still each get their own
    correct result (the encoder's word cache and scratch buffers are guarded)."""
    from concurrent.futures import ThreadPoolExecutor

    tok, fast = pair
    rng = np.random.default_rng(4)
    batches = [["".join(rng.choice(PIECES, rng.integers(200, 600)).tolist()) for _ in range(60)] for _ in range(4)]
    want = [[e.ids for e in tok.encode_batch(b, add_special_tokens=False)] for b in batches]

    def run(k):
        for _ in range(6):
            got = fast.encode_batch(batches[k])
            if got is None:  # a text NFC would change (qwen2): nothing to compare
                return True
            ids, _, counts = got
            bounds = np.concatenate([[0], np.cumsum(counts)])
            if [ids[bounds[i]:bounds[i + 1]].tolist() for i in range(len(counts))] != want[k]:
                return False
        return True

    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(run, range(4)))
