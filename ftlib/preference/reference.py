"""The reference log-probabilities of preference tuning, with no second model where possible.

``reference_pair_logps`` runs the same model with its adapters disabled
(``ftlib.lora.disable_adapters``: no weight copied) under ``torch.no_grad()``, or a separate frozen
model, or reads the values a batch carries when the pair cache holds a reference computed once by
``precompute_reference`` (then training runs no reference pass at all).
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import numpy as np
import torch

from .._dist import comm_device, get_rank, get_world_size
from ..losses import IGNORE_INDEX
from .logprobs import PairLogps, pair_logps

__all__ = ["precompute_reference", "reference_pair_logps"]


@torch.no_grad()
def reference_pair_logps(model, batch: dict, *, reference_model=None, autocast=None,
                         chunk_size: int = 1024) -> PairLogps:
    """Reference log-probs of a pair batch, with no gradient.

    In order: the batch's precomputed ``ref_chosen`` / ``ref_rejected`` when present (token counts
    from the labels); else ``reference_model`` when given (a frozen model, e.g. for full fine-tuning);
    else ``model`` with its adapters disabled. ``autocast``: a callable returning a context manager
    (e.g. ``opt.autocast``) so the reference runs in the training precision.
    """
    if "ref_chosen" in batch:
        labels = batch["labels"]
        # token counts per document from the labels, as sequence_logprobs counts them
        valid = labels[:, 1:] != IGNORE_INDEX
        if "cu_seqlens" in batch:
            t = labels.shape[1]
            pos = valid.nonzero()
            cu = batch["cu_seqlens"].to(labels.device, torch.int64)
            doc = torch.searchsorted(cu, pos[:, 0] * t + pos[:, 1] + 1, right=True) - 1
            count = torch.zeros(cu.numel() - 1, dtype=torch.int64, device=labels.device).index_add(
                0, doc, torch.ones_like(doc))
        else:
            count = valid.sum(1)
        ci, ri = batch["chosen_index"].to(count.device), batch["rejected_index"].to(count.device)
        return PairLogps(batch["ref_chosen"].float(), batch["ref_rejected"].float(), count[ci], count[ri])
    ctx = autocast() if autocast is not None else nullcontext()
    if reference_model is not None:
        with ctx:
            return pair_logps(reference_model, batch, chunk_size=chunk_size)
    from ..lora import disable_adapters, lora_layers

    if not any(True for _ in lora_layers(model)):
        raise ValueError("reference_pair_logps: the model has no adapters to disable; pass reference_model= (a "
                         "frozen copy of the starting model) or precompute the reference into the pair cache")
    with disable_adapters(model), ctx:
        return pair_logps(model, batch, chunk_size=chunk_size)


def precompute_reference(model, cache, name: str, *, pad_id: int, seq_len: int | None = None,
                         batch_size: int = 1, reference_model=None, autocast=None, device=None,
                         chunk_size: int = 1024, description: str = "", progress: bool = True):
    """Compute every pair's reference log-probs once and store them in the pair cache.

    Writes ``<cache>/reference/<name>.safetensors`` (``chosen``, ``rejected``: float64 [n_pairs],
    summed over response tokens; metadata: the cache fingerprint, ``description``) atomically and
    attaches it (``cache.reference``), so the ``PairLoader`` batches carry ``ref_chosen`` /
    ``ref_rejected`` and ``reference_pair_logps`` reads them. The pass runs like
    ``reference_pair_logps`` (adapters disabled, or ``reference_model``; ``autocast`` a context
    factory such as ``opt.autocast``), in packed rows of ``seq_len`` (default: the longest pair),
    ``batch_size`` rows per forward. Under torch.distributed every rank must call it: each computes
    its share of the pairs, the values are summed across ranks, rank 0 writes the file and every
    rank attaches it. Returns the cache.
    """
    from .._atomic import atomic_write
    from ..data import PairLoader

    world, rank = get_world_size(), get_rank()
    ref_attached, cache.reference = cache.reference, None  # batches must not carry an old reference
    try:
        sc, sr = cache.side_lengths
        seq_len = seq_len or int((sc + sr).max())
        loader = PairLoader(cache, batch_size=batch_size, pad_id=pad_id, seq_len=seq_len, packing=True,
                            shuffle=False, drop_last=False, rank=rank, world_size=world)
        values = np.zeros((3, len(cache)))  # chosen, rejected, computed-here count
        it = loader
        if progress and rank == 0:
            from tqdm.auto import tqdm

            it = tqdm(loader, total=len(loader), desc=f"reference {name}")
        for batch in it:
            ids = batch["pair_ids"].numpy()
            if device is not None:
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            ref = reference_pair_logps(model, batch, reference_model=reference_model, autocast=autocast,
                                       chunk_size=chunk_size)
            values[0, ids] = ref.chosen.double().cpu().numpy()
            values[1, ids] = ref.rejected.double().cpu().numpy()
            values[2, ids] += 1
        if world > 1:
            t = torch.from_numpy(values).to(comm_device())
            torch.distributed.all_reduce(t)
            values = t.cpu().numpy()
    except BaseException:
        cache.reference = ref_attached
        raise
    chosen, rejected, seen = values
    bad = np.flatnonzero((seen != 1) | ~np.isfinite(chosen) | ~np.isfinite(rejected))
    if len(bad):
        raise RuntimeError(f"precompute_reference: {len(bad)} pairs got no single finite reference log-prob "
                           f"(first: pair {int(bad[0])})")
    if rank == 0:
        from safetensors.numpy import save

        meta = {"cache_fingerprint": cache.fingerprint(), "name": name, "n_pairs": str(len(cache)),
                "description": description, "format": "ftlib-pair-reference-v1"}
        path = cache.reference_path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = save({"chosen": np.ascontiguousarray(chosen), "rejected": np.ascontiguousarray(rejected)},
                    metadata=meta)
        atomic_write(path, lambda tmp: tmp.write_bytes(data))
    if world > 1:
        torch.distributed.barrier()
    cache.load_reference(name)
    return cache
