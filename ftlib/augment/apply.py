"""The ``augment`` step of a loop and its settings, ``AugmentConfig``.

``augment(batch, synonyms, lexicon, config, seed=, step=)`` returns a new batch whose
``input_ids`` (and, by ``config.labels``, ``labels``) went through ``ftlib.kernels.augment_tokens``:
per token, with probability ``swap_prob`` and a tag in ``swap_tags`` it becomes a uniformly chosen
synonym; otherwise with probability ``mask_prob`` and a tag in ``mask_tags`` it becomes the mask
token. ``AugmentConfig.params`` resolves tag names and probabilities into the kernel's
``AugmentParams`` (integer thresholds floor(p * 2^32), int64 tag bit masks), checked against
the tables. The exact rules and the random numbers (Philox4x32-10 keyed by (seed, step, flat
token index)) are in ``ftlib.kernels.augment_ref``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.augment import augment_tokens
from ..kernels.augment_ref import MAX_TAG, AugmentParams, probability_threshold
from .tables import PosLexicon, SynonymTable

__all__ = ["AugmentConfig", "augment"]

_LABEL_MODES = ("keep", "follow")


def _check_tags(name: str, tags) -> str | tuple:
    if isinstance(tags, str):
        if tags != "all":
            raise ValueError(f"AugmentConfig.{name} must be 'all' or a list of tag names/ids, got {tags!r}")
        return tags
    try:
        out = tuple(tags)
    except TypeError:
        raise ValueError(f"AugmentConfig.{name} must be 'all' or a list of tag names/ids, got {tags!r}") from None
    for t in out:
        if isinstance(t, bool) or not isinstance(t, (str, int)):
            raise ValueError(f"AugmentConfig.{name}: {t!r} is neither a tag name nor a tag id")
    return out


@dataclass(frozen=True)
class AugmentConfig:
    """Settings of ``augment`` (see the module docstring).

    - ``swap_prob``, ``swap_tags``: a token whose tag is in ``swap_tags`` and that has synonyms
      becomes one of them, chosen uniformly, with probability ``swap_prob``.
    - ``mask_prob``, ``mask_tags``, ``mask_token_id``: otherwise a token whose tag is in
      ``mask_tags`` becomes ``mask_token_id`` with probability ``mask_prob``.
    - tag sets are ``"all"`` (every tag, unknown included; protected tokens never) or tag names
      / ids of the lexicon.
    - ``protect_prompt``: tokens without loss (label -100: prompts, padding) never change.
    - ``labels``: ``"keep"`` (targets stay the original tokens: denoising) or ``"follow"``
      (a changed token's target becomes the new token); ``drop_masked``: masked positions get
      label -100.
    - ``pad_id``: tokens equal to it never change (padding of packed rows without labels).
    """

    swap_prob: float = 0.1
    mask_prob: float = 0.0
    swap_tags: str | tuple = "all"
    mask_tags: str | tuple = "all"
    mask_token_id: int | None = None
    protect_prompt: bool = True
    labels: str = "keep"
    drop_masked: bool = False
    pad_id: int | None = None

    def __post_init__(self):
        for name in ("swap_prob", "mask_prob"):
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) <= 1.0:
                raise ValueError(f"AugmentConfig.{name} must be a probability in [0, 1], got {p!r}")
        object.__setattr__(self, "swap_tags", _check_tags("swap_tags", self.swap_tags))
        object.__setattr__(self, "mask_tags", _check_tags("mask_tags", self.mask_tags))
        if self.labels not in _LABEL_MODES:
            raise ValueError(f"AugmentConfig.labels must be one of {_LABEL_MODES}, got {self.labels!r}")
        for name in ("mask_token_id", "pad_id"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"AugmentConfig.{name} must be a non-negative token id or None, got {v!r}")
        if self.mask_prob > 0 and self.mask_token_id is None:
            raise ValueError("AugmentConfig: mask_prob > 0 needs a mask_token_id (e.g. resolve_token_id(tok, '<mask>'))")

    def tag_bits(self, lexicon: PosLexicon, which: str) -> int:
        """The int64 bit mask of ``swap_tags`` / ``mask_tags`` over ``lexicon``'s tag ids."""
        tags = getattr(self, which)
        if tags == "all":
            return (1 << (MAX_TAG + 1)) - 1
        bits = 0
        for t in tags:
            i = lexicon.tag_id(t) if isinstance(t, str) else t
            if not 0 <= i < len(lexicon.tag_names):
                raise ValueError(f"AugmentConfig.{which}: tag id {i} does not exist; the lexicon has ids "
                                 f"0..{len(lexicon.tag_names) - 1} ({list(lexicon.tag_names)})")
            bits |= 1 << i
        return bits

    def params(self, synonyms: SynonymTable, lexicon: PosLexicon, seed: int, step: int) -> AugmentParams:
        """The kernel scalars for one call, checked against the tables."""
        if lexicon.vocab_size != synonyms.vocab_size:
            raise ValueError(f"the POS lexicon covers {lexicon.vocab_size} ids but the synonym table "
                             f"{synonyms.vocab_size}: build both for the same vocabulary")
        vocab = synonyms.vocab_size
        for name in ("mask_token_id", "pad_id"):
            v = getattr(self, name)
            if v is not None and v >= vocab:
                raise ValueError(f"AugmentConfig.{name}={v} does not exist: the vocabulary has {vocab} ids")
        for name, v in (("seed", seed), ("step", step)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < 2**64:
                raise ValueError(f"augment: {name} must be a Python int in [0, 2^64), got {v!r}")
        return AugmentParams(
            seed=int(seed), step=int(step),
            swap_threshold=probability_threshold(self.swap_prob),
            mask_threshold=probability_threshold(self.mask_prob) if self.mask_token_id is not None else 0,
            swap_tag_bits=self.tag_bits(lexicon, "swap_tags"), mask_tag_bits=self.tag_bits(lexicon, "mask_tags"),
            mask_token_id=-1 if self.mask_token_id is None else self.mask_token_id,
            pad_id=-1 if self.pad_id is None else self.pad_id,
            protect_unlabeled=self.protect_prompt, follow_labels=self.labels == "follow",
            drop_masked=self.drop_masked,
        )


def augment(batch: Mapping, synonyms: SynonymTable, lexicon: PosLexicon, config: AugmentConfig | None = None,
            seed: int = 0, step: int = 0) -> dict:
    """A new batch dict with augmented ``input_ids`` (and ``labels`` by ``config.labels``).

    ``batch`` follows the batch contract (``input_ids``, ``labels``; ``attention_mask`` for
    padded batches, whose zeros are never touched); other keys pass through. The tables must be
    on the batch's device (move them once). Same (seed, step) gives the same result on every
    device and backend; use a different step for every micro-batch and seed + rank per rank.
    """
    config = AugmentConfig() if config is None else config
    if not isinstance(synonyms, SynonymTable) or not isinstance(lexicon, PosLexicon):
        raise TypeError("augment(batch, synonyms, lexicon, ...): expected a SynonymTable and a PosLexicon, got "
                        f"{type(synonyms).__name__} and {type(lexicon).__name__}")
    if "input_ids" not in batch:
        raise ValueError(f"augment: the batch has no 'input_ids' (keys: {sorted(batch)})")
    labels = batch.get("labels")
    if labels is None and config.protect_prompt:
        raise ValueError("augment: protect_prompt=True needs the batch's 'labels' (-100 marks the prompt); "
                         "pass labels or set protect_prompt=False")
    params = config.params(synonyms, lexicon, seed, step)
    ids = batch["input_ids"]
    if torch.is_tensor(ids) and ids.device != synonyms.device:
        raise ValueError(f"augment: the synonym table is on {synonyms.device} but the batch is on {ids.device}; "
                         "move the tables once before the loop: synonyms, lexicon = synonyms.to(device), "
                         "lexicon.to(device)")
    new_ids, new_labels = augment_tokens(ids, labels, batch.get("attention_mask"), lexicon.tags,
                                         synonyms.offsets, synonyms.candidates, params)
    out = dict(batch)
    out["input_ids"] = new_ids
    if labels is not None:
        out["labels"] = new_labels
    return out
