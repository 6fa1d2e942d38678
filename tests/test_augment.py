"""Augmentation tables through real tokenizers, TSV loaders, the config and the ``augment`` step.

Tokenizers are trained or written here (no download): byte-level BPE (GPT-2 / Llama-3 style,
``Ġword``), SentencePiece-style Metaspace (Mistral / Llama-2 ``▁word``), and a word-level
vocabulary behind a ``Prepend("▁")`` normalizer (Llama-2's tokenizer.json layout).
"""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ftlib.augment import (
    PROTECTED_TAG,
    AugmentConfig,
    PosLexicon,
    SynonymTable,
    augment,
    build_pos_lexicon,
    build_synonym_table,
    load_lexicon_dir,
    pos_lexicon_from_function,
    read_pos_tsv,
    read_synonyms_tsv,
    resolve_token_id,
    special_token_ids,
)

TEXT = ["the happy dog is glad and the big cat is large", "Happy people are glad people and Glad dogs",
        "a quick brown fox jumps over the lazy dog", "cheerful"] * 30
SPECIALS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>"]


@pytest.fixture(scope="module")
def bpe():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def metaspace():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS[:3]))
    return tok


@pytest.fixture(scope="module")
def prepend():
    vocab = {"<unk>": 0, "<s>": 1, "▁happy": 2, "▁glad": 3, "▁dog": 4, "happy": 5, "▁▁happy": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.add_special_tokens(["<unk>", "<s>"])
    return tok


def _id(tok, s):
    i = tok.token_to_id(s)
    assert i is not None, s
    return i


# ----------------------------------------------------------------------------------------------
# Synonym table through tokenizers
# ----------------------------------------------------------------------------------------------

def test_byte_level_bpe_variants_keep_spacing_and_case(bpe):
    # In this vocabulary: happy, Ġhappy, glad, Ġglad, Glad, ĠGlad, cheerful, Happy, Ġdog, Ġcat, cat are
    # single tokens; " cheerful", " Happy", "dog", "very glad" are not.
    table = build_synonym_table(bpe, {"happy": ["glad", "cheerful", "very glad"], "dog": ["cat"]})
    sp = lambda w: _id(bpe, "Ġ" + w)  # noqa: E731
    assert table.synonyms_of(sp("happy")) == [sp("glad")]  # after a space: Ġ -> Ġ only
    assert table.synonyms_of(_id(bpe, "happy")) == [_id(bpe, "glad"), _id(bpe, "cheerful")]  # bare -> bare
    assert table.synonyms_of(_id(bpe, "Happy")) == [_id(bpe, "Glad")]  # generated Title-case form
    assert table.synonyms_of(sp("dog")) == [sp("cat")]
    assert table.synonyms_of(_id(bpe, "cat")) == []  # not symmetric by default
    cov = table.coverage
    assert cov.words == 2 and cov.words_kept == 2 and cov.entries == 5 and cov.tokens == 4
    assert cov.variants == {"space": 2, "bare": 2, "Title bare": 1}
    assert cov.dropped == {"synonym not a single token": ["happy -> very glad"]}
    assert "happy -> very glad" in cov.summary() and "2/2 words kept" in cov.summary()


def test_metaspace_sentencepiece_variants(metaspace):
    table = build_synonym_table(metaspace, {"happy": ["glad"], "Happy": ["Glad"]})
    assert table.synonyms_of(_id(metaspace, "▁happy")) == [_id(metaspace, "▁glad")]
    assert table.synonyms_of(_id(metaspace, "▁Happy")) == [_id(metaspace, "▁Glad")]
    assert table.num_candidates == 2  # bare and space forms are the same ▁ token: merged, not duplicated


def test_prepend_normalizer_and_unknown_tokens_are_not_single_tokens(prepend):
    # "▁▁happy" maps to a real token, and " dog" to <unk> (one token, but special): neither counts.
    table = build_synonym_table(prepend, {"happy": ["glad"], "dog": ["puppy"]}, vocab_size=10)
    assert table.vocab_size == 10
    assert table.synonyms_of(2) == [3] and table.num_candidates == 1
    assert table.coverage.dropped["special token"] == ["dog -> puppy"]


def test_specials_multi_token_and_self_synonyms_are_reported(bpe):
    table = build_synonym_table(bpe, {"<mask>": ["dog"], "cat": ["<pad>", "cat", "zzzq"], "quickly": ["fast"],
                                      "big": ["quickly"]}, title_case=False)
    d = table.coverage.dropped
    assert d["special token"] == ["<mask>", "cat -> <pad>"]
    assert d["word not a single token"] == ["quickly"]  # neither "quickly" nor " quickly" is one token
    assert d["synonym not a single token"] == ["cat -> zzzq", "big -> quickly"]
    assert d["no synonym left"] == ["cat", "big"]
    assert table.num_candidates == 0 and table.coverage.words_kept == 0
    assert all(v not in table.candidates.tolist() for v in special_token_ids(bpe))


def test_symmetric(bpe):
    table = build_synonym_table(bpe, {"big": ["cat"]}, symmetric=True, title_case=False)
    assert table.synonyms_of(_id(bpe, "Ġcat")) == [_id(bpe, "Ġbig")]
    assert table.synonyms_of(_id(bpe, "Ġbig")) == [_id(bpe, "Ġcat")]


def test_vocab_size_must_cover_the_tokenizer(bpe):
    with pytest.raises(ValueError, match="smaller than the tokenizer's"):
        build_synonym_table(bpe, {"big": ["cat"]}, vocab_size=10)
    with pytest.raises(TypeError, match="list of words"):
        build_synonym_table(bpe, {"big": "cat"})


def test_from_lists_and_constructor_errors():
    t = SynonymTable.from_lists(5, {0: [4, 4, 1], 4: [0]})
    assert t.synonyms_of(0) == [4, 1] and t.synonyms_of(4) == [0] and t.synonyms_of(2) == []
    with pytest.raises(ValueError, match="synonym id 5 of token 0 is outside the vocabulary \\[0, 5\\)"):
        SynonymTable.from_lists(5, {0: [5]})
    with pytest.raises(ValueError, match="synonym id -1 of token 3"):
        SynonymTable.from_lists(5, {3: [-1]})
    with pytest.raises(ValueError, match="token id 7 is outside"):
        SynonymTable.from_lists(5, {7: [1]})
    with pytest.raises(ValueError, match="token 2 lists itself"):
        SynonymTable.from_lists(5, {2: [2]})
    with pytest.raises(ValueError, match="decreases at token 1"):
        SynonymTable(torch.tensor([0, 2, 1, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="end at len\\(candidates\\)=2"):
        SynonymTable(torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# POS lexicon
# ----------------------------------------------------------------------------------------------

def test_pos_lexicon_from_words(bpe):
    lex = build_pos_lexicon(bpe, {"happy": "ADJ", "glad": "ADJ", "dog": "NOUN", "Dog": "PROPN", "quickly": "ADV",
                                  "<mask>": "X"})
    assert lex.tag_names == ("UNK", "ADJ", "ADV", "NOUN", "PROPN", "X")
    assert lex.tag_of(_id(bpe, "Ġhappy")) == "ADJ" and lex.tag_of(_id(bpe, "happy")) == "ADJ"
    assert lex.tag_of(_id(bpe, "Ġdog")) == "NOUN" and lex.tag_of(_id(bpe, "Happy")) == "ADJ"
    assert lex.tag_of(_id(bpe, "Ġcat")) == "UNK"
    for s in SPECIALS:
        assert int(lex.tags[_id(bpe, s)]) == PROTECTED_TAG
    d = lex.coverage.dropped
    assert d == {"word not a single token": ["Dog", "quickly"], "special token": ["<mask>"]}
    assert lex.coverage.words_kept == 3 and lex.coverage.tokens == 8  # happy x3, glad x4 (+ ĠGlad), Ġdog


def test_pos_conflicts_are_reported():
    # A lowercasing normalizer maps "Bear" and "bear" to one token: the first entry keeps it.
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "bear": 1, "run": 2}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>"])
    lex = build_pos_lexicon(tok, {"bear": "NOUN", "Bear": "PROPN", "run": "VERB", "Run": "VERB"})
    assert lex.tag_of(1) == "NOUN" and lex.tag_of(2) == "VERB"
    assert lex.coverage.dropped == {"conflicting tag, first kept": ["Bear/PROPN vs bear/NOUN"],
                                    "same tokens as an earlier word": ["Run"]}


def test_pos_lexicon_from_function(bpe):
    seen = []

    def tag(text):
        seen.append(text)
        return "NOUN" if text.strip() in ("dog", "cat") else None

    lex = pos_lexicon_from_function(bpe, tag)
    assert lex.tag_of(_id(bpe, "Ġdog")) == "NOUN" and lex.tag_of(_id(bpe, "Ġcat")) == "NOUN"
    assert " dog" in seen and "<mask>" not in seen  # decoded text with its space; specials are not offered
    assert int(lex.tags[_id(bpe, "<mask>")]) == PROTECTED_TAG
    assert "ordinary tokens tagged" in lex.coverage.summary()
    with pytest.raises(ValueError, match="expected a tag name"):
        pos_lexicon_from_function(bpe, lambda t: 3)


def test_pos_lexicon_errors():
    with pytest.raises(ValueError, match="token 1 has tag id 4, but there are only 2 tags"):
        PosLexicon(torch.tensor([0, 4, 1], dtype=torch.uint8), ("UNK", "NOUN"))
    with pytest.raises(ValueError, match="tag_names\\[0\\] must be 'UNK'"):
        PosLexicon(torch.zeros(3, dtype=torch.uint8), ("NOUN",))
    with pytest.raises(ValueError, match="at most 62 fit"):
        PosLexicon(torch.zeros(3, dtype=torch.uint8), ("UNK", *[f"T{i}" for i in range(63)]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        PosLexicon.blank(4).protect([4])
    lex = PosLexicon.blank(4, special_ids=[3])
    assert lex.tags.tolist() == [0, 0, 0, PROTECTED_TAG]


# ----------------------------------------------------------------------------------------------
# TSV loaders
# ----------------------------------------------------------------------------------------------

def test_read_tsv_files(tmp_path):
    f = tmp_path / "syn.tsv"
    f.write_bytes("\ufeff# synonyms\nhappy\tglad\tcheerful\r\n\n  # indented comment\nhappy\tglad\tjoyful\n"
                  "big\t large \n".encode())
    assert read_synonyms_tsv(f) == {"happy": ["glad", "cheerful", "joyful"], "big": ["large"]}
    g = tmp_path / "syn.tsv.gz"
    g.write_bytes(gzip.compress(b"dog\tcat"))  # no final newline
    assert read_synonyms_tsv(g) == {"dog": ["cat"]}
    p = tmp_path / "pos.tsv"
    p.write_text("happy\tADJ\ndog\tNOUN\nhappy\tADJ\n")
    assert read_pos_tsv(p) == {"happy": "ADJ", "dog": "NOUN"}


@pytest.mark.parametrize("content,match", [
    (b"happy\tglad\nhappy\n", r"syn.tsv:2: expected word<TAB>synonym.*got 1 field"),
    (b"happy\t\tglad\n", r"syn.tsv:1: field 2 is empty"),
    (b"ok\tfine\nbad\t\xff\xfe\n", r"syn.tsv:2: not valid UTF-8"),
    (b"ok\tfine\ncaf\xc3", r"syn.tsv:2: not valid UTF-8"),  # a file cut inside a character
])
def test_read_synonyms_tsv_errors(tmp_path, content, match):
    f = tmp_path / "syn.tsv"
    f.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        read_synonyms_tsv(f)


def test_lenient_tsv_reports_every_skip(tmp_path):
    f = tmp_path / "syn.tsv"
    f.write_bytes(b"a\tb\nbad\nc\t\td\n\xff\tx\ne\tf\n")
    with pytest.warns(UserWarning, match=r"skipped 3 malformed lines: line 2: .*; line 3: .*; line 4: not valid UTF-8"):
        assert read_synonyms_tsv(f, strict=False) == {"a": ["b"], "e": ["f"]}
    p = tmp_path / "pos.tsv"
    p.write_text("dog\tNOUN\ndog\tVERB\ncat\n")
    with pytest.raises(ValueError, match=r"pos.tsv:2: 'dog' tagged 'VERB' here but 'NOUN' on line 1"):
        read_pos_tsv(p)
    with pytest.warns(UserWarning) as rec:
        assert read_pos_tsv(p, strict=False) == {"dog": "NOUN"}
    msgs = " | ".join(str(w.message) for w in rec)
    assert "line 3: expected 2 tab-separated fields" in msgs and "line 2: 'dog' tagged 'VERB'" in msgs


def test_truncated_gzip(tmp_path):
    f = tmp_path / "syn.tsv.gz"
    f.write_bytes(gzip.compress(b"a\tb\n" * 1000)[:40])
    with pytest.raises(ValueError, match="syn.tsv.gz: cannot be read"):
        read_synonyms_tsv(f)


def test_load_lexicon_dir(tmp_path, bpe):
    (tmp_path / "synonyms.tsv").write_text("happy\tglad\n")
    syn, lex = load_lexicon_dir(bpe, tmp_path)
    assert syn.synonyms_of(_id(bpe, "Ġhappy")) == [_id(bpe, "Ġglad")]
    assert lex.tag_names == ("UNK",) and int(lex.tags[_id(bpe, "<s>")]) == PROTECTED_TAG
    (tmp_path / "pos.tsv").write_text("happy\tADJ\n")
    assert load_lexicon_dir(bpe, tmp_path)[1].tag_of(_id(bpe, "Ġhappy")) == "ADJ"
    with pytest.raises(FileNotFoundError, match="synonyms.tsv: not found"):
        load_lexicon_dir(bpe, tmp_path / "nope")


# ----------------------------------------------------------------------------------------------
# Config and the augment step
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(swap_prob=1.5), r"swap_prob must be a probability in \[0, 1\], got 1.5"),
    (dict(mask_prob=-0.1, mask_token_id=1), "mask_prob must be a probability"),
    (dict(swap_prob=float("nan")), "swap_prob"),
    (dict(mask_prob=0.1), "needs a mask_token_id"),
    (dict(labels="shift"), "labels must be one of"),
    (dict(swap_tags="nouns"), "'all' or a list"),
    (dict(mask_tags=[1.5]), "neither a tag name nor a tag id"),
    (dict(mask_token_id=-3), "mask_token_id must be a non-negative"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        AugmentConfig(**kw)


def _tables(bpe):
    syn = build_synonym_table(bpe, {"happy": ["glad", "cheerful"], "dog": ["cat"], "big": ["large"]})
    lex = build_pos_lexicon(bpe, {"happy": "ADJ", "glad": "ADJ", "dog": "NOUN", "cat": "NOUN", "the": "DET"})
    return syn, lex


def _packed_batch(bpe, n_rows=2, seq_len=64):
    """Prompt/response documents packed into rows, each tail padded with <pad> (labels -100 there)."""
    from ftlib.data import collate_packed, pack

    docs = []
    for i in range(12):
        prompt = bpe.encode(f"<s>the big dog {i}", add_special_tokens=False).ids
        answer = bpe.encode(" the happy dog is glad and the dog is happy</s>", add_special_tokens=False).ids
        docs.append((np.array(prompt + answer), np.array([0] * len(prompt) + [1] * len(answer))))
    plan = pack([len(d[0]) for d in docs], seq_len)
    return collate_packed(plan, list(range(min(n_rows, plan.n_rows))), docs.__getitem__, _id(bpe, "<pad>"))


def test_augment_packed_batch_end_to_end(bpe):
    syn, lex = _tables(bpe)
    batch = _packed_batch(bpe)
    mask = resolve_token_id(bpe, "<mask>")
    cfg = AugmentConfig(swap_prob=0.5, mask_prob=0.3, mask_token_id=mask, mask_tags=("NOUN", "DET"))
    out = augment(batch, syn, lex, cfg, seed=1, step=0)
    assert set(out) == set(batch) and out["cu_seqlens"] is batch["cu_seqlens"]
    ids, new = batch["input_ids"], out["input_ids"]
    prompt = batch["labels"] == -100  # prompts, first tokens, pad tails
    assert torch.equal(new[prompt], ids[prompt])
    special = torch.isin(ids, torch.tensor(sorted(special_token_ids(bpe))))
    assert torch.equal(new[special], ids[special])
    changed = new != ids
    assert int(changed.sum()) > 5
    masked = changed & (new == mask)
    assert bool(masked.any()) and bool((changed & ~masked).any())
    for old, now in zip(ids[changed & ~masked].tolist(), new[changed & ~masked].tolist()):
        assert now in syn.synonyms_of(old)
    assert out["labels"] is batch["labels"]  # keep: denoising targets
    again = augment(batch, syn, lex, cfg, seed=1, step=0)
    assert torch.equal(again["input_ids"], new)
    assert not torch.equal(augment(batch, syn, lex, cfg, seed=1, step=1)["input_ids"], new)

    follow = augment(batch, syn, lex, AugmentConfig(**{**cfg.__dict__, "labels": "follow", "drop_masked": True}),
                     seed=1, step=0)
    assert torch.equal(follow["input_ids"], new)  # the label mode never changes the ids
    lab = follow["labels"]
    assert bool((lab[masked] == -100).all())
    swapped = changed & ~masked
    assert torch.equal(lab[swapped], new[swapped]) and torch.equal(lab[~changed], batch["labels"][~changed])


def test_augment_padded_batch_never_touches_padding(bpe):
    from ftlib.data import pad_collate

    syn, lex = _tables(bpe)
    docs = [(np.array(bpe.encode(t).ids), np.ones(len(bpe.encode(t).ids))) for t in ("happy dog", " the happy dog is big " * 3)]
    pad = resolve_token_id(bpe, "<pad>")
    for side in ("left", "right"):
        batch = pad_collate(docs, pad, padding_side=side)
        batch["input_ids"][batch["attention_mask"] == 0] = _id(bpe, "Ġhappy")  # pads that look like words
        cfg = AugmentConfig(swap_prob=1.0, protect_prompt=False)
        out = augment(batch, syn, lex, cfg, seed=0, step=0)
        am = batch["attention_mask"] == 0
        assert torch.equal(out["input_ids"][am], batch["input_ids"][am])
        assert bool((out["input_ids"] != batch["input_ids"]).any())


def test_augment_errors(bpe):
    syn, lex = _tables(bpe)
    batch = _packed_batch(bpe, n_rows=1)
    with pytest.raises(ValueError, match="mask_token_id=5000 does not exist: the vocabulary has"):
        augment(batch, syn, lex, AugmentConfig(mask_prob=0.1, mask_token_id=5000))
    with pytest.raises(ValueError, match="token '<MASK>' is not in the tokenizer's vocabulary; its special tokens"):
        resolve_token_id(bpe, "<MASK>")
    with pytest.raises(ValueError, match="token id 9999 does not exist"):
        resolve_token_id(bpe, 9999)
    small = PosLexicon.blank(syn.vocab_size - 1)
    with pytest.raises(ValueError, match=f"covers {syn.vocab_size - 1} ids but the synonym table {syn.vocab_size}"):
        augment(batch, syn, small)
    with pytest.raises(ValueError, match="unknown tag 'VERB'; the lexicon has tags"):
        augment(batch, syn, lex, AugmentConfig(swap_tags=("VERB",)))
    with pytest.raises(ValueError, match="tag id 9 does not exist"):
        augment(batch, syn, lex, AugmentConfig(swap_tags=(9,)))
    with pytest.raises(ValueError, match="synonym table is on meta but the batch is on cpu"):
        augment(batch, syn.to("meta"), lex.to("meta"))
    with pytest.raises(ValueError, match="step must be a Python int"):
        augment(batch, syn, lex, step=torch.tensor(3))
    with pytest.raises(ValueError, match="protect_prompt=True needs the batch's 'labels'"):
        augment({"input_ids": batch["input_ids"]}, syn, lex)
    with pytest.raises(TypeError, match="expected a SynonymTable and a PosLexicon"):
        augment(batch, lex, syn)


def test_tables_move_to_a_device_unchanged(bpe):
    syn, lex = _tables(bpe)
    s2, l2 = syn.to("cpu"), lex.to("cpu")
    assert torch.equal(s2.offsets, syn.offsets) and torch.equal(s2.candidates, syn.candidates)
    assert torch.equal(l2.tags, lex.tags) and l2.tag_names == lex.tag_names and s2.coverage is syn.coverage


def test_import_pulls_in_no_triton():
    import subprocess
    import sys

    code = ("import sys, ftlib.augment, ftlib.embed_noise, ftlib.kernels.augment; "
            "sys.exit(1 if 'triton' in sys.modules else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
