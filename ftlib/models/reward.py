"""Reward model: a scalar score head on the Llama-family decoder, in ``transformers``' sequence-classification layout.

    r(doc) = w . h_last(doc)        h_last: the final-norm hidden state of the document's last token,
                                    w = ``score.weight`` [1, H] (no bias)

trained with the Bradley-Terry pairwise loss ``-log sigmoid(r(chosen) - r(rejected) - m)``
(``ftlib.losses.bradley_terry_loss``; Bradley & Terry 1952, Ouyang et al. 2022 "InstructGPT", the
margin m of Touvron et al. 2023 "Llama 2"). The score is read at the last token of each document:

- padded batch (``attention_mask`` [B, T], left or right padding): the last real token of each row;
- packed batch (``cu_seqlens``): the last token of every segment (pass ``score_index`` to leave out
  padding segments, e.g. the tail segment of ``ftlib.data`` packed rows);
- plain batch: the last position of each row.

Only the pooled [N, H] rows go through the head. ``score(model, docs)`` packs a list of token-id
documents into varlen rows (no padding, fused attention kernels) and returns one float per document.
``pair_rewards(model, batch)`` scores a preference-pair batch of ``ftlib.data.PairLoader`` (either
layout: each side is its own padded row or its own packed segment, so chosen and rejected are scored
as separate sequences) and returns the [P] chosen and [P] rejected scores.

Files are those of ``transformers``' ``LlamaForSequenceClassification`` (``Qwen2...``, ``Mistral...``):
config.json with ``architectures``, one label (``id2label``) and ``pad_token_id``, tensors
``model.*`` and ``score.weight`` [1, H]. ``transformers`` pools at the rightmost token that is not
``pad_token_id``; that is the last real token as long as documents do not end with the pad token
(use a dedicated pad token, not EOS, when documents end with EOS). ``save_reward_model`` warns when
the pad id it writes is an EOS id: whether documents end with EOS is not known at save (the
documents are not), and refusing there would throw away a trained model at the end of a run; the
warning names the fix (``warnings.simplefilter("error")`` makes it an error). ``load_reward_model`` also
reads a causal-LM checkpoint: the LM head is dropped and the score head initialised as
``transformers`` does (N(0, initializer_range)), with a warning naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from .._atomic import atomic_write
from .._fields import json_dict, json_int
from .config import LlamaConfig
from .hub import read_config, read_weights, resolve_dtype, save_pretrained, set_tensor
from .llama import LlamaForCausalLM, LlamaModel
from .tokenizer import resolve_model_dir

__all__ = [
    "LlamaRewardModel",
    "SEQ_CLS_ARCHITECTURES",
    "last_token_index",
    "load_reward_model",
    "pair_rewards",
    "pairwise_accuracy",
    "save_reward_model",
    "score",
]

log = logging.getLogger("ftlib.models")

#: model_type -> the sequence-classification class name written to ``architectures``
SEQ_CLS_ARCHITECTURES = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "gemma2": "Gemma2ForSequenceClassification",
    "gemma3_text": "Gemma3TextForSequenceClassification",
    "phi3": "Phi3ForSequenceClassification",
    "olmo2": "Olmo2ForSequenceClassification",
    "smollm3": "SmolLM3ForSequenceClassification",
}


def last_token_index(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flattened (B*T) index of the token each document is scored at, int64 [N]."""
    b, t = input_ids.shape
    if cu_seqlens is not None:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if bool((lengths <= 0).any()):
            raise ValueError("cu_seqlens has an empty segment: no last token to score")
        return cu_seqlens[1:].to(torch.int64) - 1
    rows = torch.arange(b, device=input_ids.device) * t
    if attention_mask is None:
        return rows + (t - 1)
    mask = attention_mask.bool()
    if not bool(mask.any(-1).all()):
        raise ValueError(f"attention_mask has rows without a real token: {mask.any(-1).logical_not().nonzero().flatten().tolist()}")
    pos = torch.arange(t, device=input_ids.device).expand(b, t)
    return rows + torch.where(mask, pos, -1).amax(-1)  # the rightmost real token (left or right padding)


class LlamaRewardModel(nn.Module):
    """``model`` (LlamaModel) + ``score`` (``nn.Linear(H, 1, bias=False)``); ``forward`` returns one score per document."""

    def __init__(self, config: LlamaConfig, model: LlamaModel | None = None):
        super().__init__()
        self.config = config
        self.model = model if model is not None else LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)
        if model is None:
            LlamaForCausalLM.reset_parameters(self)  # N(0, initializer_range) linears/embeddings, unit norms
        else:
            self.reset_head()

    @classmethod
    def from_causal_lm(cls, lm: LlamaForCausalLM) -> LlamaRewardModel:
        """A reward model sharing ``lm``'s decoder (not copied), with a new score head; ``lm_head`` is not used."""
        rm = cls(lm.config, model=lm.model)
        ref = next(lm.parameters())
        rm.score.to(device=ref.device, dtype=ref.dtype)
        return rm

    def reset_head(self) -> None:
        """Initialise the score head as ``transformers`` does: N(0, initializer_range)."""
        with torch.no_grad():
            self.score.weight.normal_(0.0, self.config.initializer_range)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        # the output projection: LoRA's "all-linear" leaves it out (train it through modules_to_save=["score"])
        return self.score

    def set_gradient_checkpointing(self, every: int | None = 1, part: str = "block") -> None:
        """As ``LlamaForCausalLM.set_gradient_checkpointing``."""
        LlamaForCausalLM.set_gradient_checkpointing(self, every, part)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        score_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores [N]: N = B (padded / plain) or the number of segments (packed); ``score_index``
        (flattened B*T positions) overrides which tokens are scored."""
        hidden = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)  # (B, T, H)
        idx = last_token_index(input_ids, attention_mask, cu_seqlens) if score_index is None else score_index
        flat = hidden.reshape(-1, hidden.shape[-1])
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= flat.shape[0]):
            raise ValueError(f"score_index must lie in [0, {flat.shape[0]}), got {int(idx.min())}..{int(idx.max())}")
        return self.score(flat.index_select(0, idx.to(flat.device))).squeeze(-1)  # (N,)


# ---- batching ------------------------------------------------------------------------------------


_LAYOUT = ("attention_mask", "position_ids", "cu_seqlens", "max_seqlen")  # the batch contract of ftlib.data.collate


def pair_rewards(model: LlamaRewardModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [P], rejected [P]) scores of a pair batch (``ftlib.data.pair_batches``, padded or packed):
    one score per row or segment, read at ``chosen_index`` / ``rejected_index``."""
    r = model(batch["input_ids"], **{k: batch[k] for k in _LAYOUT if k in batch})  # (rows or segments,)
    return r[batch["chosen_index"].to(r.device)], r[batch["rejected_index"].to(r.device)]


def _packed_row(docs: Sequence[Sequence[int]], device: torch.device | str | None = None) -> dict:
    """One packed row [1, sum of lengths] holding ``docs`` (non-empty, checked by ``score``) in order:
    ``input_ids``, ``position_ids``, ``cu_seqlens`` (int32, one segment per document) and ``max_seqlen``."""
    lengths = [len(d) for d in docs]
    ids = torch.tensor([int(t) for d in docs for t in d], dtype=torch.int64)
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return {"input_ids": ids[None].to(device), "position_ids": pos[None].to(device),
            "cu_seqlens": cu.to(device), "max_seqlen": max(lengths)}


@torch.no_grad()
def score(
    model: LlamaRewardModel,
    docs: Sequence[Sequence[int]],
    *,
    max_tokens: int = 16384,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Scores of ``docs`` (lists of token ids) as float32 [len(docs)] on CPU, in the given order.

    Documents are sorted by length and packed into rows of at most ``max_tokens`` tokens (a longer
    document gets a row of its own); the model runs in eval mode (restored afterwards) under the
    caller's autocast, if any.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    for i, d in enumerate(docs):
        if len(d) == 0:
            raise ValueError(f"score: document {i} is empty")
    device = device or next(model.parameters()).device
    out = torch.empty(len(docs), dtype=torch.float32)
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i]))
    was_training = model.training
    model.eval()
    try:
        start = 0
        while start < len(order):
            end, tokens = start, 0
            while end < len(order) and (end == start or tokens + len(docs[order[end]]) <= max_tokens):
                tokens += len(docs[order[end]])
                end += 1
            chunk = order[start:end]
            batch = _packed_row([docs[i] for i in chunk], device)
            out[torch.tensor(chunk)] = model(batch["input_ids"], position_ids=batch["position_ids"],
                                             cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"]).float().cpu()
            start = end
    finally:
        model.train(was_training)
    return out


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Fraction of pairs with r(chosen) > r(rejected) (a tie counts one half)."""
    if chosen.shape != rejected.shape or chosen.numel() == 0:
        raise ValueError(f"need two equal, non-empty shapes, got {tuple(chosen.shape)} and {tuple(rejected.shape)}")
    d = chosen.float() - rejected.float()
    return float(((d > 0).float() + 0.5 * (d == 0).float()).mean())


# ---- files ---------------------------------------------------------------------------------------


def save_reward_model(model: LlamaRewardModel, path: str | os.PathLike, *, pad_token_id: int | None = None,
                      max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``model`` as ``transformers``' ``<Arch>ForSequenceClassification`` (num_labels 1); returns the files.

    ``pad_token_id`` (default ``model.config.pad_token_id``) goes into config.json: ``transformers``
    needs it to score batches of more than one row.
    """
    if not isinstance(model, LlamaRewardModel):
        raise TypeError(f"save_reward_model takes a LlamaRewardModel, got {type(model).__name__} "
                        "(merge LoRA adapters first: ftlib.lora.merge_and_unload)")
    root = Path(path)
    written = save_pretrained(model, root, max_shard_size=max_shard_size)  # tensors + a causal-LM config.json
    # config.json is rewritten (atomically) for the classification class: a crash in between leaves a
    # config that names LlamaForCausalLM next to a score.weight tensor, which every loader refuses
    cfg = json.loads((root / "config.json").read_text())
    pad = model.config.pad_token_id if pad_token_id is None else int(pad_token_id)
    if pad is None:
        log.warning("save_reward_model(%s): no pad_token_id; transformers will refuse batches of more than one "
                    "row (pass pad_token_id=)", root)
    eos = model.config.eos_token_id
    if pad is not None and pad in (eos if isinstance(eos, list) else [eos]):
        warnings.warn(
            f"save_reward_model({root}): pad_token_id {pad} is also the EOS id: transformers scores a document at "
            "its last token that is not the pad id, so on documents ending in EOS it reads the token before the EOS "
            "and its scores differ from ftlib's. Pass pad_token_id= a token documents never end with (e.g. a "
            "dedicated pad token), or score documents without a trailing EOS",
            UserWarning, stacklevel=2,
        )
    cfg.update(architectures=[SEQ_CLS_ARCHITECTURES[model.config.model_type]], id2label={"0": "LABEL_0"},
               label2id={"LABEL_0": 0}, pad_token_id=pad)
    cfg.pop("num_labels", None)
    atomic_write(root / "config.json", lambda tmp: tmp.write_text(json.dumps(cfg, indent=2) + "\n"))
    return written


def load_reward_model(path_or_repo_id: str | os.PathLike, dtype: torch.dtype | str | None = None,
                      device: torch.device | str | None = None) -> LlamaRewardModel:
    """Build a ``LlamaRewardModel`` from a sequence-classification checkpoint, or from a causal-LM one
    (its LM head dropped, a new score head initialised; logged). Errors name the file and tensor."""
    dtype, device = resolve_dtype(dtype), torch.device(device if device is not None else "cpu")
    root = resolve_model_dir(path_or_repo_id)
    config = read_config(root / "config.json")
    source = str(root / "config.json")
    id2label = json_dict(config.extra, "id2label", source, default=None, nullable=True)  # num_labels derives from it
    labels = len(id2label) if id2label else json_int(config.extra, "num_labels", source, default=1, min=1)
    if labels != 1:
        raise ValueError(f"{root / 'config.json'}: {labels} labels; a reward model has one (a scalar score)")
    with torch.device("meta"):
        model = LlamaRewardModel(config, model=LlamaModel(config))
    expected = dict(model.state_dict(keep_vars=True))
    loaded = read_weights(model, root, expected, dtype=dtype, device=device,
                           what=f"a {config.model_type} reward model", skip=lambda name: name == "lm_head.weight")
    if "score.weight" not in loaded:
        ref = loaded.get("model.embed_tokens.weight")
        like = model.model.embed_tokens.weight if ref else None
        w = torch.empty(expected["score.weight"].shape, device=device,
                        dtype=dtype or (like.dtype if like is not None else torch.float32))
        set_tensor(model, "score.weight", w.normal_(0.0, config.initializer_range))
        loaded["score.weight"] = "(initialised)"
        log.warning("load_reward_model(%s): no score.weight (a causal-LM checkpoint?); the score head is newly "
                    "initialised", root)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{root}: checkpoint is missing tensors {missing[:5]}{more}")
    return model
