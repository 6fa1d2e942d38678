"""ftlib.metrics: the FLOPs formula against torch's FLOP counter, token statistics, the JSONL logger,
resume truncation, the device peak table, plots and TensorBoard."""

import json
import os
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from ftlib.data import collate_packed, pack, pad_collate
from ftlib.lora import LoRAConfig, apply_lora
from ftlib.metrics import (
    FlopsModel,
    MetricsLogger,
    TokenStats,
    device_peak_flops,
    peak_memory_bytes,
    plot_metrics,
    read_metrics,
)
from ftlib.models import LlamaConfig, LlamaForCausalLM
from ftlib.optim import StepResult

CFG = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


def _measured(model, ids, batched_linear=False):
    """(linear-layer FLOPs, attention FLOPs) torch counts for forward + backward over ids.

    ``batched_linear``: count ``bmm``/``baddbmm`` as linear FLOPs (a LoRA layer accumulates B's
    product into a 3-D base output with ``baddbmm_``; use it where attention runs SDPA's kernels,
    which torch counts under their own names, so no attention ``bmm`` is mixed in)."""
    fc = FlopCounterMode(display=False)
    # torch's counter has no formula for oneDNN's product (ftlib.kernels.linear, frozen fp32 on CPU)
    with fc, mock.patch.dict(os.environ, {"FTLIB_LINEAR_BACKEND": "torch"}):
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    linear = counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)
    if batched_linear:
        return linear + counts.get("aten.bmm", 0) + counts.get("aten.baddbmm", 0), 0
    return linear, counts.get("aten.bmm", 0)


def test_linear_flops_equal_torchs_count_for_full_finetuning(monkeypatch):
    # the reference attention: its matmuls are what torch's counter sees (it has no formula for the
    # CPU flash-attention kernels the default path calls)
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "torch")
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    f = FlopsModel.from_model(model)
    n_linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert f.body + f.head == n_linear == f.body_trainable + f.head_trainable
    assert (f.layers, f.attn_dim) == (2, 32)
    B, T = 2, 9
    linear, attn = _measured(model, torch.randint(0, 61, (B, T)))
    assert linear == f.flops(B * T, B * T, 0)  # 6 N per token, exactly
    # the CPU reference attention computes all T^2 (query, key) pairs and masks; model FLOPs count
    # the causal T(T+1)/2 only
    assert attn == 12 * f.layers * f.attn_dim * B * T * T
    assert f.flops_per_token(T) == 6 * n_linear + 6 * f.layers * f.attn_dim * (T + 1)


def test_lora_flops_count_adapters_and_only_trained_weight_gradients():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="all-linear"), verbose=False)
    f = FlopsModel.from_model(model)
    n_lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert f.body_trainable == n_lora and f.head_trainable == 0
    linear, _ = _measured(model, torch.randint(0, 61, (2, 9)), batched_linear=True)
    want = f.flops(18, 18, 0)
    # layer 0's input needs no gradient (the embedding is frozen): autograd skips those few input
    # gradients, which the formula counts (it is an upper bound within a few percent)
    assert 0.9 * want < linear <= want


def test_nf4_base_counts_as_its_dense_shape():
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    dense = FlopsModel.from_model(LlamaForCausalLM(CFG))
    model = LlamaForCausalLM(CFG)
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="all-linear", quantize="nf4"), verbose=False)
    q = FlopsModel.from_model(model)
    n_lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert q.body + q.head == dense.body + dense.head + n_lora


@settings(max_examples=30)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(41, 64), st.data())
def test_token_stats_of_packed_and_padded_batches(lengths, seq_len, data):
    """Invariants: real tokens = sum of document lengths; pairs = sum n(n+1)/2; padding = 1 - real/(B*T)."""
    pad = 0
    docs = [(np.arange(1, n + 1, dtype=np.int64), np.ones(n, np.uint8)) for n in lengths]  # no pad id inside
    plan = pack(np.array(lengths), seq_len, "split")
    batch = collate_packed(plan, list(range(plan.n_rows)), lambda d: docs[d], pad)
    s = TokenStats().add(batch, pad)
    assert s.tokens == sum(lengths) and s.positions == plan.n_rows * seq_len
    assert s.attn_pairs == sum(n * (n + 1) // 2 for n in lengths)
    assert s.padding_fraction == pytest.approx(1 - sum(lengths) / (plan.n_rows * seq_len))
    assert s.targets == int((batch["labels"][:, 1:] != -100).sum())
    side = data.draw(st.sampled_from(["right", "left"]))
    padded = pad_collate([docs[i] for i in range(len(lengths))], pad, padding_side=side)
    p = TokenStats().add(padded, pad)
    assert p.tokens == sum(lengths) and p.attn_pairs == s.attn_pairs
    both = TokenStats().add(batch, pad).add(padded, pad)
    assert both.tokens == 2 * sum(lengths)


def _result(loss=1.0, norm=2.0, clipped=1.0, skipped=False):
    clip = {"grad_norm": norm, "grad_norm_clipped": clipped, "clipped": float(clipped < norm), "clip_scale": 0.5}
    return StepResult(skipped=skipped, loss=loss, num_tokens=10, grad_norm=norm, loss_scale=None, clip=clip,
                      nan_source=None)


def _packed_batch():
    docs = [(np.arange(1, 6), np.ones(5, np.uint8)), (np.arange(1, 4), np.ones(3, np.uint8))]
    plan = pack(np.array([5, 3]), 10, "split")
    return collate_packed(plan, list(range(plan.n_rows)), lambda d: docs[d], 0)


def test_logger_writes_and_flushes_a_line_per_step(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    flops = FlopsModel.from_model(LlamaForCausalLM(CFG))
    logger = MetricsLogger(path, total_steps=4, flops=flops, peak_flops=1e12, progress=False, print_every=2)
    for step in (1, 2):
        rec = logger.step(step, _result(loss=3.0 - step), lr=1e-3, tokens=TokenStats().add(_packed_batch(), 0),
                          skipped_steps=0)
        lines = path.read_text().splitlines()  # readable before close: flushed per step
        assert len(lines) == step and json.loads(lines[-1]) == rec
    assert rec["clip_ratio"] == 0.5 and rec["grad_norm"] == 2.0 and rec["grad_norm_clipped"] == 1.0
    assert rec["tokens"] == 8 and rec["padding_fraction"] == pytest.approx(0.2)
    work = flops.flops(8, rec_targets := 8 - 2, 15 + 6)
    assert rec_targets == TokenStats().add(_packed_batch(), 0).targets
    # step_time_s is logged to 0.1 ms and mfu to 1e-4, from the unrounded time: a sub-millisecond
    # step's mfu lies between the values the rounded time's ends give, each within mfu's rounding
    dt = rec["step_time_s"]
    lo, hi = work / (dt + 5e-5) / 1e12, (work / (dt - 5e-5) / 1e12 if dt > 5e-5 else float("inf"))
    assert lo - 5e-5 <= rec["mfu"] <= hi + 5e-5
    assert rec["peak_mem_gib"] > 0 and rec["eta_s"] >= 0
    logger.eval(2, {"eval_loss": 0.5, "eval_ppl": 1.6})
    logger.step(3, _result(loss=float("nan"), skipped=True), lr=1e-3, skipped_steps=1)
    logger.close()
    recs = read_metrics(path)
    assert [r["step"] for r in recs] == [1, 2, 2, 3] and recs[2]["kind"] == "eval"
    assert recs[3]["loss"] is None and recs[3]["skipped"] is True  # strict JSON: NaN written as null
    out = capsys.readouterr().out
    assert "step 2/4 | loss 1.0000" in out and "eval @ step 2: eval_loss 0.5000" in out


def test_resumed_logger_drops_records_past_its_start_and_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLogger(path, progress=False, print_every=None) as logger:
        for step in range(1, 6):
            logger.step(step, _result(), lr=1.0)
        logger.eval(4, {"eval_loss": 1.0})
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # a kill in the middle of a write
    with pytest.raises(ValueError, match=r"m.jsonl:7: bad metrics record"):
        read_metrics(path)
    with pytest.warns(UserWarning, match="skipped 1 unreadable line"):
        logger = MetricsLogger(path, start_step=3, progress=False, print_every=None)
    logger.step(4, _result(), lr=2.0)
    logger.close()
    assert [(r["step"], r["lr"]) for r in read_metrics(path)] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0)]


def test_only_rank_zero_writes(tmp_path):
    logger = MetricsLogger(tmp_path / "m.jsonl", rank=1, progress=False)
    rec = logger.step(1, _result(), lr=1.0)
    logger.close()
    assert rec["loss"] == 1.0 and not (tmp_path / "m.jsonl").exists()


def test_device_peak_table(monkeypatch):
    assert device_peak_flops("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, want in [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H200", 989.4),
                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.05), ("NVIDIA GeForce RTX 4090", 165.2),
                       ("Tesla T4", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        got = device_peak_flops("cuda", "bf16")
        assert got == (None if want is None else want * 1e12), name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100 80GB PCIe")
    assert device_peak_flops("cuda", "fp32") in (19.5e12, 156e12)  # tf32 when allowed
    monkeypatch.setenv("FTLIB_PEAK_TFLOPS", "123")
    assert device_peak_flops("cpu") == 123e12
    monkeypatch.setenv("FTLIB_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="FTLIB_PEAK_TFLOPS"):
        device_peak_flops("cuda")
    assert peak_memory_bytes("cpu") > 2**20


PEAK_NAMES = [("NVIDIA H100 NVL", 835.5), ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H100 80GB HBM3", 989.4),
              ("NVIDIA H200 NVL", 835.5), ("NVIDIA L40S", 362.05), ("NVIDIA L4", 121.0), ("NVIDIA A10G", 125.0)]


def test_peak_lookup_the_most_specific_name_wins(monkeypatch):
    from ftlib import metrics

    for table in (dict(metrics.PEAK_TFLOPS), dict(reversed(metrics.PEAK_TFLOPS.items()))):  # order plays no part
        monkeypatch.setattr(metrics, "PEAK_TFLOPS", table)
        for name, want in PEAK_NAMES:
            assert metrics.peak_tflops_for(name, "bf16") == want, name
            assert metrics.peak_tflops_for(name.lower(), "bf16") == want, name
    assert metrics.peak_tflops_for("Tesla T4") is None
    with pytest.raises(ValueError, match="precision"):
        metrics.peak_tflops_for("NVIDIA H100", "int8")


def _bench_train():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
    spec = importlib.util.spec_from_file_location("bench_train_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("gpu_1b", [False, True], ids=["cpu-shape", "llama-3.2-1b-shape"])
def test_bench_train_mfu_uses_ftlib_flops_and_peaks(monkeypatch, gpu_1b):
    """The benchmark's MFU is ftlib.metrics' (one FLOPs model, one peak table), not a copy of its own."""
    bench = _bench_train()
    shape, vocab = bench.model_shape({"gpu_1b": gpu_1b}), 8192
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **shape))
        model.requires_grad_(False)
        apply_lora(model, LoRAConfig(target_modules="all-linear", **bench.LORA), verbose=False)
    fm = FlopsModel.from_model(model)
    for lens, targets in (([2048], 2048), ([2048], 1536), ([100, 7, 900], 700)):
        pairs = sum(n * (n + 1) // 2 for n in lens)
        assert bench.step_flops(shape, vocab, lens, targets) == pytest.approx(fm.flops(sum(lens), targets, pairs),
                                                                              rel=1e-12), lens
    args = type("Args", (), {"peak_tflops": None, "device": "cuda"})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, want in PEAK_NAMES:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert bench.device_peak_tflops(args) == pytest.approx(want), name


def test_plot_metrics_writes_a_png_and_needs_matplotlib(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    path = tmp_path / "m.jsonl"
    with MetricsLogger(path, progress=False, print_every=None) as logger:
        for step in range(1, 8):
            logger.step(step, _result(loss=1.0 / step), lr=1e-3 * step)
        logger.eval(7, {"eval_loss": 0.3})
    png = plot_metrics(path, tmp_path / "m.png", title="demo")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_metrics(path, tmp_path / "n.png")


def test_plot_metrics_adds_a_throughput_panel_when_logged(tmp_path, monkeypatch):
    """Records with tokens_per_s get a fourth panel (tokens / s against the step); without, three panels."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    made = []
    real = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    rows = [{"step": s, "loss": 1.0 / s, "lr": 1e-3, "grad_norm": 1.0} for s in range(1, 6)]
    for name, extra in (("with", {"tokens_per_s": 1000.0}), ("without", {})):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r | extra) + "\n" for r in rows))
        plot_metrics(path, tmp_path / f"{name}.png")
    (fig4, axes4), (fig3, axes3) = made
    assert len(axes4) == 4 and len(axes3) == 3
    assert axes4[3].get_ylabel() == "tokens / s"
    assert list(axes4[3].lines[0].get_ydata()) == [1000.0] * 5 and list(axes4[3].lines[0].get_xdata()) == [1, 2, 3, 4, 5]


def _tb_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_one_logger_writes_the_same_records_to_the_file_and_tensorboard(tmp_path):
    """``report_to``: the trackers get each record's numbers at its step (train/ and eval/), beside the
    JSONL; a resumed logger drops TensorBoard's events past its start step, as it does the file's lines."""
    pytest.importorskip("tensorboard")
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsLogger(path, progress=False, print_every=None, report_to=["tensorboard"]) as logger:
        for step in (1, 2, 3):
            logger.step(step, _result(loss=float(step)), lr=0.5)
        logger.eval(3, {"eval_loss": 0.25})
        logger.log({"step": 3, "kind": "eval", "accuracy": 0.75, "note": "text is not a scalar"})
    got = _tb_scalars(tmp_path / "run" / "tb")
    assert got["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0)] and got["train/lr"] == [(1, 0.5), (2, 0.5), (3, 0.5)]
    assert got["eval/eval_loss"] == [(3, 0.25)] and got["eval/accuracy"] == [(3, 0.75)]
    assert not any(tag.endswith("note") or tag.endswith("kind") for tag in got)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 3, 3]
    with MetricsLogger(path, progress=False, print_every=None, report_to=["tensorboard"], start_step=1) as logger:
        logger.step(2, _result(loss=9.0), lr=0.5)
    assert _tb_scalars(tmp_path / "run" / "tb")["train/loss"] == [(1, 1.0), (2, 9.0)]
    assert [r["loss"] for r in read_metrics(path)] == [1.0, 9.0]


def test_trackers_are_checked_and_only_rank_0_writes(tmp_path):
    with pytest.raises(ValueError, match="unknown logger 'mlflow' \\(known: tensorboard, wandb\\)"):
        MetricsLogger(None, progress=False, report_to=["mlflow"])
    with pytest.raises(ValueError, match="needs a folder: give MetricsLogger a path or log_dir"):
        MetricsLogger(None, progress=False, report_to=["tensorboard"])
    MetricsLogger(None, progress=False, rank=1, report_to=["tensorboard"], log_dir=tmp_path / "r1").close()
    assert not (tmp_path / "r1").exists()


def test_open_loggers_is_a_deprecated_metrics_logger_without_a_file(tmp_path):
    pytest.importorskip("tensorboard")
    from ftlib.train import open_loggers

    with pytest.warns(DeprecationWarning, match="pass report_to=.* to ftlib.metrics.MetricsLogger"):
        loggers = open_loggers(["tensorboard"], out=tmp_path)
    assert isinstance(loggers, MetricsLogger)
    loggers.log({"step": 4, "loss": 2.0})
    loggers.close()
    assert _tb_scalars(tmp_path / "tb") == {"train/loss": [(4, 2.0)]} and list(tmp_path.iterdir()) == [tmp_path / "tb"]
