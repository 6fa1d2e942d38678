"""Training metrics a person can watch: progress bar, JSONL per step, MFU, peak memory, plots.

    logger = MetricsLogger(out / "metrics.jsonl", total_steps=total, start_step=step,
                           flops=FlopsModel.from_model(model), peak_flops=device_peak_flops(device, "bf16"))
    for ...:                                   # one optimizer step
        window = TokenStats()
        for batch in micro_batches:
            window.add(batch, pad_id)          # before the batch goes to the device
            ...
        result = opt.step(clipper)
        logger.step(step, result, lr=sched.get_last_lr()[0], tokens=window, skipped_steps=opt.skipped_steps)
    logger.eval(step, {"eval_loss": ..., "eval_ppl": ...})
    logger.close()

One object a loop calls once per step: the JSONL file, the bar or printed lines, and the experiment
trackers of ``report_to`` (``LOGGERS``: TensorBoard under ``<log_dir>/tb``, Weights & Biases under
``<log_dir>/wandb``, ``log_dir`` defaulting to the JSONL file's folder) all get the same record.
    plot_metrics(out / "metrics.jsonl", out / "metrics.png")

Every ``step`` writes one JSON line and flushes it (a killed run keeps every step it logged; a
resumed logger drops the lines past its ``start_step``): loss, LR, gradient norm before and after
clipping and their ratio, target tokens, real (non-padding) tokens, padding fraction, tokens/s,
step time, skipped steps, fp16 loss scale, MFU and peak memory (CUDA ``max_memory_allocated``,
else the process's peak RSS). A tqdm bar shows loss, LR, tokens/s and the ETA on rank 0 when
stderr is a terminal; otherwise a line is printed every ``print_every`` steps. The trackers get
the numeric fields: ``train/<key>`` for step records, ``eval/<key>`` for evaluation records, at the
record's ``step``. Each is imported when asked for, and a missing package is an ``ImportError``
saying what to install. W&B runs offline with ``WANDB_MODE=offline``; a resumed run keeps its W&B run
id (``<log_dir>/wandb_run_id``) and TensorBoard drops the events past ``start_step``.

FLOPs (model FLOPs, the MFU convention of PaLM, Chowdhery et al. 2022, appendix B: recomputation
by activation checkpointing is not counted, padding is not counted). A linear layer with weight
[out, in] costs 2·in·out FLOPs per token forward, as much again backward for the gradient of its
input, and 2·in·out more for its weight gradient only when the weight is trained. With N the
weights of all linear layers of the body (LoRA adapters included; an NF4 weight counts as in·out),
N_t the trained ones, and H, H_t the same for the LM head, a step over tokens t costs

    F = (4·N + 2·N_t)·tokens + (4·H + 2·H_t)·targets + 12·L·d·sum_docs n(n + 1)/2

where ``targets`` are the tokens with a label (the chunked loss computes the head there only),
L the layers, d = heads·head_dim the attention width and n each document's length: causal
attention computes q·k and p·v for the n(n + 1)/2 (query, key) pairs of a document, 4·d FLOPs per
pair forward and twice that backward. For full fine-tuning on full rows of T tokens this is the
familiar 6·N + 6·L·d·(T + 1) per token; for LoRA (N_t ≈ 0) it is about 4·N. MFU = F per second /
(peak FLOP/s of one device · devices); ``PEAK_TFLOPS`` holds dense (no sparsity) tensor-core
peaks from NVIDIA's datasheets per precision, ``peak_flops=`` or ``FTLIB_PEAK_TFLOPS`` override.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ._atomic import atomic_write
from ._dist import comm_device, get_world_size

__all__ = [
    "FlopsModel",
    "LOGGERS",
    "MetricsLogger",
    "PEAK_TFLOPS",
    "TokenStats",
    "device_peak_flops",
    "peak_memory_bytes",
    "peak_tflops_for",
    "plot_metrics",
    "read_metrics",
]

# Dense peak TFLOP/s per GPU from NVIDIA's datasheets (sparsity figures halved). A key matches as a
# substring of torch.cuda.get_device_name(); of several matching keys the longest (most specific)
# wins, whatever the order here ("NVIDIA H100 NVL" is the NVL, not the SXM "H100"; "NVIDIA L40S" is
# not the "L4"). "fp32" is the plain (non-tensor-core) rate, what fp32 matmuls get unless TF32 is on.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM5
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10G": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},  # the A10 datasheet's figures
    "4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},  # tensor cores with fp32 accumulation
}
_PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def peak_tflops_for(device_name: str, precision: str = "bf16") -> float | None:
    """Dense peak TFLOP/s of the GPU called ``device_name`` (as ``torch.cuda.get_device_name`` says it)
    for ``precision`` (bf16, fp16, tf32, fp32), or None when the table has no entry for it.

    The most specific entry wins: the longest key contained in the name (case-insensitive).
    """
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(_PRECISIONS)}, got {precision!r}")
    name = device_name.lower()
    keys = [k for k in PEAK_TFLOPS if k.lower() in name]
    return PEAK_TFLOPS[max(keys, key=len)][precision] if keys else None


def device_peak_flops(device: torch.device | str | None = None, precision: str = "bf16") -> float | None:
    """Peak FLOP/s of one ``device`` for ``precision`` (bf16, fp16, fp32), or None when unknown.

    ``FTLIB_PEAK_TFLOPS`` (a number) overrides the table. fp32 on CUDA counts as tf32 when
    ``torch.backends.cuda.matmul.allow_tf32`` is on. CPUs have no entry: pass ``peak_flops``.
    """
    env = os.environ.get("FTLIB_PEAK_TFLOPS")
    if env:
        try:
            return float(env) * 1e12
        except ValueError:
            raise ValueError(f"FTLIB_PEAK_TFLOPS must be a number of TFLOP/s, got {env!r}") from None
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"
    peak = peak_tflops_for(torch.cuda.get_device_name(device), precision)
    return None if peak is None else peak * 1e12


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """CUDA ``max_memory_allocated`` of ``device``, else the process's peak resident set size."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # Windows
        return 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


# ---- FLOPs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopsModel:
    """Weights of the linear layers (see the module doc) and the attention shape of a decoder."""

    body: int
    body_trainable: int
    head: int
    head_trainable: int
    layers: int
    attn_dim: int

    @classmethod
    def from_model(cls, model: nn.Module, head: str = "lm_head") -> FlopsModel:
        """Count from ``model``'s linear layers (``nn.Linear`` and NF4 bases) and its ``config``."""
        from .lora.nf4 import NF4Linear

        counts = {"body": 0, "body_trainable": 0, "head": 0, "head_trainable": 0}
        seen = set()
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear):
                n, trained = mod.in_features * mod.out_features, mod.weight.requires_grad
                key = id(mod.weight)
            elif isinstance(mod, NF4Linear):
                n, trained, key = mod.in_features * mod.out_features, False, id(mod)
            else:
                continue
            if key in seen:
                continue
            seen.add(key)
            part = "head" if name == head or name.startswith(head + ".") else "body"
            counts[part] += n
            if trained:
                counts[part + "_trainable"] += n
        cfg = getattr(model, "config", None)
        layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
        heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
        head_dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // max(heads, 1))
        return cls(layers=layers, attn_dim=heads * int(head_dim), **counts)

    def flops(self, tokens: int, targets: int, attn_pairs: int) -> float:
        """Training FLOPs of a step over ``tokens`` real tokens (see the module doc)."""
        return (float(4 * self.body + 2 * self.body_trainable) * tokens
                + float(4 * self.head + 2 * self.head_trainable) * targets
                + 12.0 * self.layers * self.attn_dim * attn_pairs)

    def flops_per_token(self, seq_len: int) -> float:
        """FLOPs per token for rows of one ``seq_len``-token document, every token a target."""
        return self.flops(seq_len, seq_len, seq_len * (seq_len + 1) // 2) / seq_len


@dataclass
class TokenStats:
    """Token counts of one or more batches (``add`` each micro-batch of a window).

    ``tokens``: real tokens; ``positions``: B·T; ``targets``: tokens with a label (under the
    loss's shift); ``attn_pairs``: sum over documents of n(n + 1)/2. In a packed batch a
    segment of ``pad_id`` tokens without labels is padding; in a padded one ``attention_mask``.
    """

    tokens: int = 0
    positions: int = 0
    targets: int = 0
    attn_pairs: int = 0

    def add(self, batch: dict, pad_id: int | None = None) -> TokenStats:
        ids = batch["input_ids"].detach().cpu().numpy()
        labels = batch["labels"].detach().cpu().numpy()
        B, T = ids.shape
        self.positions += B * T
        self.targets += int((labels[:, 1:] != -100).sum())
        if "cu_seqlens" in batch:
            cu = batch["cu_seqlens"].detach().cpu().numpy().astype(np.int64)
            lengths = np.diff(cu)
            keep = lengths > 0
            starts, lengths = cu[:-1][keep], lengths[keep]
            if pad_id is not None and len(starts):
                pad_tok = ((ids == pad_id) & (labels == -100)).reshape(-1).astype(np.int64)
                real = np.add.reduceat(pad_tok, starts) != lengths  # a segment of pads only is padding
                lengths = lengths[real]
        elif "attention_mask" in batch:
            lengths = batch["attention_mask"].detach().cpu().numpy().astype(bool).sum(1)
        else:
            lengths = np.full(B, T)
        self.tokens += int(lengths.sum())
        self.attn_pairs += int((lengths * (lengths + 1) // 2).sum())
        return self

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.positions if self.positions else 0.0

    def all_reduce(self) -> TokenStats:
        """Sum over ranks (a no-op unless torch.distributed is initialised); every rank must call it."""
        if get_world_size() == 1:
            return self
        t = torch.tensor([self.tokens, self.positions, self.targets, self.attn_pairs], dtype=torch.int64,
                         device=comm_device())
        torch.distributed.all_reduce(t)
        return TokenStats(*(int(x) for x in t.tolist()))


# ---- the logger -------------------------------------------------------------------------------


def _fmt_time(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def read_metrics(path: str | os.PathLike, *, lenient: bool = False) -> list[dict]:
    """The records of a metrics JSONL file; a bad line raises naming file and line (or, ``lenient``,
    is skipped with a warning counting the skipped lines)."""
    path = Path(path)
    out, bad = [], []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "step" not in rec:
                raise ValueError("not an object with a 'step'")
        except ValueError as e:
            if not lenient:
                raise ValueError(f"{path}:{i}: bad metrics record ({e})") from None
            bad.append(i)
            continue
        out.append(rec)
    if bad:
        warnings.warn(f"{path}: skipped {len(bad)} unreadable line(s) {bad[:5]} (a run killed mid-write?)",
                      stacklevel=2)
    return out


# ---- experiment trackers ----------------------------------------------------------------------

LOGGERS = ("tensorboard", "wandb")  # the trackers ``MetricsLogger(report_to=...)`` can write to


def _scalars(rec: dict):
    prefix = "eval/" if rec.get("kind") == "eval" else "train/"
    for k, v in rec.items():
        if k not in ("step", "kind") and isinstance(v, (int, float)) and not isinstance(v, bool):
            yield prefix + k, v


class _TensorBoard:
    def __init__(self, log_dir: Path, start_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("--report-to tensorboard needs the tensorboard package: pip install tensorboard") from e
        self.w = SummaryWriter(str(log_dir / "tb"), purge_step=start_step + 1 if start_step else None)

    def log(self, rec: dict) -> None:
        for k, v in _scalars(rec):
            self.w.add_scalar(k, v, rec["step"])

    def close(self) -> None:
        self.w.close()


class _Wandb:
    def __init__(self, log_dir: Path, config: dict, name: str | None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("--report-to wandb needs the wandb package: pip install wandb") from e
        id_file = log_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        self.run = wandb.init(dir=str(log_dir), config=config, name=name, id=run_id,
                              resume="allow" if run_id else None)
        if run_id is None:
            id_file.write_text(self.run.id + "\n")

    def log(self, rec: dict) -> None:
        self.run.log(dict(_scalars(rec)), step=rec["step"])

    def close(self) -> None:
        self.run.finish()


def _open_trackers(names, log_dir: Path | None, start_step: int, config: dict | None, run_name: str | None) -> list:
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"unknown logger {unknown[0]!r} (known: {', '.join(LOGGERS)})")
    if names and log_dir is None:
        raise ValueError(f"report_to={names} needs a folder: give MetricsLogger a path or log_dir")
    if names:
        log_dir.mkdir(parents=True, exist_ok=True)
    return [_TensorBoard(log_dir, start_step) if n == "tensorboard" else _Wandb(log_dir, dict(config or {}), run_name)
            for n in names]


class MetricsLogger:
    """Per-step metrics: JSONL (flushed each step), a tqdm bar or printed lines, TensorBoard / W&B.

    ``path``: the JSONL file (None: no file); ``total_steps``: for the bar and the ETA;
    ``start_step``: the step a resumed run continues from (records after it are dropped from an
    existing file, which is then appended to); ``flops`` and ``peak_flops`` (FLOP/s per device)
    enable MFU; ``world_size`` devices share the work; only ``rank`` 0 writes or prints, but every
    rank must call ``step`` under torch.distributed (token counts are summed over ranks).
    ``progress``: None = a bar when stderr is a terminal. ``print_every``: steps between printed
    lines when there is no bar (None: never). ``report_to``: names in ``LOGGERS``, written under
    ``log_dir`` (default: ``path``'s folder), W&B with ``run_config`` and ``run_name``.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, total_steps: int | None = None, start_step: int = 0,
                 flops: FlopsModel | None = None, peak_flops: float | None = None, world_size: int = 1,
                 rank: int = 0, device: torch.device | str | None = None, progress: bool | None = None,
                 print_every: int | None = 10, report_to=(), log_dir: str | os.PathLike | None = None,
                 run_config: dict | None = None, run_name: str | None = None):
        self.path = Path(path) if path is not None else None
        self.total, self.start_step, self.flops, self.peak = total_steps, start_step, flops, peak_flops
        self.world, self.rank, self.device, self.print_every = world_size, rank, device, print_every
        self.main = rank == 0
        self._t0 = self._last = time.perf_counter()
        self._steps_timed = 0
        self._file = None
        self._trackers: list = []
        self._bar = None
        self.last: dict = {}
        if not self.main:
            return
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                self._truncate_after(start_step)
            self._file = open(self.path, "a")  # noqa: SIM115 -- closed in close()
        if log_dir is None and self.path is not None:
            log_dir = self.path.parent
        self._trackers = _open_trackers(report_to, None if log_dir is None else Path(log_dir), start_step,
                                        run_config, run_name)
        if progress is None:
            progress = sys.stderr.isatty()
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _truncate_after(self, step: int) -> None:
        keep = [r for r in read_metrics(self.path, lenient=True) if r["step"] <= step]
        text = "".join(json.dumps(r) + "\n" for r in keep)
        atomic_write(self.path, lambda p: p.write_text(text))

    def write(self, msg: str) -> None:
        """Print ``msg`` on rank 0 without breaking the bar."""
        if not self.main:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def log(self, rec: dict) -> None:
        """Write a record built elsewhere (a ``{"step": ..., ...}`` dict; ``"kind": "eval"`` ones go
        under ``eval/``) to the JSONL file and every tracker, on rank 0; ``step`` and ``eval`` call it."""
        if not self.main:
            return
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        for t in self._trackers:
            t.log(rec)

    def step(self, step: int, result=None, *, lr: float, tokens: TokenStats | None = None,
             skipped_steps: int | None = None, **extra) -> dict:
        """Record optimizer step ``step`` (a ``StepResult`` or None); return the record."""
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        self._steps_timed += 1
        tokens = tokens.all_reduce() if tokens is not None else None
        rec: dict = {"step": step, "time_s": round(now - self._t0, 3), "step_time_s": round(dt, 4), "lr": lr}
        if result is not None:
            clip = result.clip or {}
            before = result.grad_norm
            after = clip.get("grad_norm_clipped", before)
            rec.update(loss=result.loss, grad_norm=before, grad_norm_clipped=after,
                       clip_ratio=after / before if before and math.isfinite(before) and before > 0 else 1.0,
                       skipped=result.skipped, target_tokens=result.num_tokens)
            if result.loss_scale is not None:
                rec["loss_scale"] = result.loss_scale
        if skipped_steps is not None:
            rec["skipped_steps"] = skipped_steps
        if tokens is not None:
            rec.update(tokens=tokens.tokens, padding_fraction=round(tokens.padding_fraction, 4),
                       tokens_per_s=round(tokens.tokens / dt, 1) if dt > 0 else None)
            if self.flops is not None and dt > 0:
                achieved = self.flops.flops(tokens.tokens, tokens.targets, tokens.attn_pairs) / dt
                rec["tflops"] = round(achieved / 1e12 / self.world, 3)  # per device
                if self.peak:
                    rec["mfu"] = round(achieved / (self.peak * self.world), 4)
        rec["peak_mem_gib"] = round(peak_memory_bytes(self.device) / 2**30, 3)
        if self.total is not None:
            per_step = (now - self._t0) / self._steps_timed
            rec["eta_s"] = round(max(self.total - step, 0) * per_step, 1)
        rec.update(extra)
        for k, v in rec.items():  # strict JSON: a non-finite loss or norm is written as null
            if isinstance(v, float) and not math.isfinite(v):
                rec[k] = None
        self.last = rec
        if not self.main:
            return rec
        self.log(rec)
        if self._bar is not None:
            post = {"loss": f"{rec.get('loss', float('nan')):.4f}" if rec.get("loss") is not None else "nan",
                    "lr": f"{lr:.2e}"}
            if rec.get("tokens_per_s") is not None:
                post["tok/s"] = f"{rec['tokens_per_s']:,.0f}"
            if "mfu" in rec:
                post["mfu"] = f"{rec['mfu']:.1%}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self.print_every and (step % self.print_every == 0 or step == self.total):
            self.write(self._line(rec))
        return rec

    def _line(self, rec: dict) -> str:
        parts = [f"step {rec['step']}" + (f"/{self.total}" if self.total else "")]
        if rec.get("loss") is not None:
            parts.append(f"loss {rec['loss']:.4f}")
        parts.append(f"lr {rec['lr']:.2e}")
        if rec.get("grad_norm") is not None:
            parts.append(f"grad {rec['grad_norm']:.3f}")
        if rec.get("tokens_per_s") is not None:
            parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
        if "mfu" in rec:
            parts.append(f"mfu {rec['mfu']:.1%}")
        if rec.get("skipped_steps"):
            parts.append(f"skipped {rec['skipped_steps']}")
        parts.append(f"mem {rec['peak_mem_gib']:.2f} GiB")
        if "eta_s" in rec:
            parts.append(f"eta {_fmt_time(rec['eta_s'])}")
        return " | ".join(parts)

    def eval(self, step: int, metrics: dict) -> dict:
        """Record evaluation ``metrics`` measured at ``step`` (a line with ``"kind": "eval"``)."""
        rec = {"step": step, "kind": "eval", **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                                for k, v in metrics.items()}}
        if self.main:
            self.log(rec)
            self.write(f"eval @ step {step}: " + ", ".join(
                f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
        return rec

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
        for t in self._trackers:
            t.close()
        self._trackers = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- plot -------------------------------------------------------------------------------------


def plot_metrics(jsonl: str | os.PathLike, png: str | os.PathLike, *, title: str | None = None) -> Path:
    """Draw loss (train, and eval when logged), LR, gradient norm (before/after clipping) and, when the
    records have ``tokens_per_s``, throughput to ``png``."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plot_metrics needs matplotlib: pip install matplotlib") from e
    recs = read_metrics(jsonl, lenient=True)
    train = [r for r in recs if r.get("kind") != "eval"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    if not train:
        raise ValueError(f"{jsonl}: no training records to plot")

    def series(rows, key):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [p[1] for p in pts]

    tput = series(train, "tokens_per_s")
    fig, axes = plt.subplots(4 if tput[0] else 3, 1, figsize=(8, 10.5 if tput[0] else 8), sharex=True)
    ax = axes[0]
    ax.plot(*series(train, "loss"), lw=1, label="train loss")
    if evals:
        ax.plot(*series(evals, "eval_loss"), "o-", ms=4, label="eval loss")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    axes[1].plot(*series(train, "lr"), lw=1, color="tab:green")
    axes[1].set_ylabel("learning rate")
    axes[2].plot(*series(train, "grad_norm"), lw=1, color="tab:red", label="before clipping")
    axes[2].plot(*series(train, "grad_norm_clipped"), lw=1, color="tab:purple", alpha=0.7, label="after clipping")
    axes[2].set_ylabel("gradient norm")
    axes[2].set_yscale("log")
    axes[2].legend()
    if tput[0]:  # throughput of each logged step (MetricsLogger's tokens_per_s: the step's tokens / its time)
        axes[3].plot(*tput, lw=1, color="tab:orange")
        axes[3].set_ylabel("tokens / s")
        axes[3].set_ylim(bottom=0)
    axes[-1].set_xlabel("optimizer step")
    for a in axes:
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png = Path(png)
    atomic_write(png, lambda p: fig.savefig(p, dpi=100, format="png"))
    plt.close(fig)
    return png

