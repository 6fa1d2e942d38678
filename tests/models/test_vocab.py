"""A tokenizer with ids past the model's embedding is refused at load, naming both files."""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from ftlib.models import check_vocab, load_pretrained, load_tokenizer, save_pretrained


def _tokenizer(path, n):
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, n)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return tok


def test_tokenizer_larger_than_the_model_in_its_folder(make_model, tmp_path):
    model = make_model()  # vocab_size 128
    save_pretrained(model, tmp_path / "m")
    _tokenizer(tmp_path / "m", 129)  # ids 0..128: id 128 has no embedding row
    with pytest.raises(ValueError) as e:
        load_tokenizer(tmp_path / "m")
    msg = str(e.value)
    assert str(tmp_path / "m" / "tokenizer.json") in msg and str(tmp_path / "m" / "config.json") in msg, msg
    assert "up to 128" in msg and "vocab_size 128" in msg
    # what the check prevents: the id is out of the embedding's range
    with pytest.raises(IndexError):
        model(torch.tensor([[128]]))


def test_tokenizer_that_fits_loads(make_model, tmp_path):
    save_pretrained(make_model(), tmp_path / "m")
    _tokenizer(tmp_path / "m", 128)
    assert len(load_tokenizer(tmp_path / "m")) == 128
    _tokenizer(tmp_path / "m", 100)  # fewer ids than embedding rows (padded vocabularies) is normal
    load_tokenizer(tmp_path / "m")


def test_check_vocab_across_folders(make_model, tmp_path):
    save_pretrained(make_model(), tmp_path / "m")
    model = load_pretrained(tmp_path / "m")
    _tokenizer(tmp_path / "t", 200)
    tok = load_tokenizer(tmp_path / "t")  # no config.json beside it: nothing to compare at load
    with pytest.raises(ValueError) as e:
        check_vocab(tok, model)
    assert str(tmp_path / "t" / "tokenizer.json") in str(e.value) and str(tmp_path / "m" / "config.json") in str(e.value)
    with pytest.raises(ValueError, match="vocab_size 128"):
        check_vocab(tok, model.config, model_source="base/config.json")
    with pytest.raises(ValueError, match="vocab_size 150"):
        check_vocab(tok, 150)
    check_vocab(tok, 200)
    check_vocab(tok, json.loads((tmp_path / "m" / "config.json").read_text()) | {"vocab_size": 256})
