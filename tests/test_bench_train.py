"""benchmarks/bench_train.py's same-data reference: hf-rows feeds transformers exactly ftlib's documents."""

import importlib.util
from pathlib import Path

import numpy as np
import torch

from ftlib.data import TokenLoader


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
    spec = importlib.util.spec_from_file_location("bench_train_same_data", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hf_rows_batches_hold_the_packed_rows_documents_and_their_loss_tokens():
    bench = _bench()
    corpus = bench.Corpus(512, 60, seed=0, max_len=256)
    docs = {tuple(corpus[i][0].tolist()): corpus[i][1] for i in range(len(corpus))}
    loader = TokenLoader(corpus, batch_size=2, seq_len=512, pad_id=0, packing=True, seed=0)
    for b in list(loader)[:3]:
        ids, labels = b["input_ids"].reshape(-1), b["labels"].reshape(-1)
        spans = bench.packed_spans(b)
        assert sum(e - s for s, e in spans) == int((ids != 0).sum())  # every real token, no pad tail
        padded = bench.pad_batch([(ids[s:e].numpy().astype(np.int32), (labels[s:e] != -100).numpy())
                                  for s, e in spans])
        assert int((padded["labels"] != -100).sum()) == int((labels != -100).sum())  # the same loss tokens
        for s, e in spans:
            tok = tuple(ids[s:e].tolist())
            assert tok in docs  # a whole document of the corpus
            assert torch.equal(labels[s:e] != -100, torch.from_numpy(docs[tok]).bool())


def test_ftlib_variants_are_checked_against_the_same_data_run_when_it_ran():
    bench = _bench()
    assert bench.loss_reference("ftlib", "hf-budget", "hf-rows") == "hf-rows"
    assert bench.loss_reference("ftlib-compile", "hf-budget", "hf-rows") == "hf-rows"
    assert bench.loss_reference("hf-sorted", "hf-budget", "hf-rows") == "hf-budget"
    assert bench.loss_reference("ftlib", "hf-budget", None) == "hf-budget"


def _run(loss, tok=1000.0):
    return {"tokens_per_s": tok, "tokens_per_cpu_s": tok, "tflops": float("nan"), "peak_mb": 1000.0,
            "train_loss": loss, "heldout_loss": loss, "steps": 4, "tokens": 6000, "timed_s": 6.0, "warmup_s": 1.0,
            "gemm_rel_err": None}


def test_held_out_check_uses_the_same_data_run_and_says_so_when_it_is_missing(capsys):
    bench = _bench()
    results = {"ftlib": [_run(8.78172)], "hf-budget": [_run(8.72080)]}
    out = bench.summarize(8192, results, list(results), loss_tol=0.005)
    assert not out["med"]["ftlib"]["loss_ok"]  # +0.70 % against a run on other batches
    assert "add hf-rows" in capsys.readouterr().out
    results["hf-rows"] = [_run(8.78170, tok=100.0)]
    out = bench.summarize(8192, results, list(results), loss_tol=0.005)
    med = out["med"]
    assert out["best"] == "hf-budget" and med["ftlib"]["loss_ref"] == "hf-rows" and med["ftlib"]["loss_ok"]
    assert abs(med["ftlib"]["loss_rel"]) < 1e-5 and med["ftlib"]["loss_rel_best"] > 0.005
    assert "all correct variants pass" in capsys.readouterr().out
    results["hf-rows"] = [_run(8.70, tok=100.0)]  # ftlib off the same-data run: the check fails
    assert not bench.summarize(8192, results, list(results), loss_tol=0.005)["med"]["ftlib"]["loss_ok"]
