"""On-device token augmentation: synonym table, POS lexicon, and the ``augment`` step of a loop.

Text augmentation usually runs on the CPU before tokenization, giving the same noisy copy every
epoch. Here it runs on the token batch already on the device, fresh at every step, in one
memory-bound pass (``ftlib.kernels.augment_tokens``: a Triton kernel with a bit-identical PyTorch
reference). Per token, with probability ``swap_prob`` and a tag in ``swap_tags`` it becomes a
uniformly chosen synonym; otherwise with probability ``mask_prob`` and a tag in ``mask_tags`` it
becomes the mask token. Padding, special tokens and (by default) prompt tokens (label -100)
never change. Labels either keep the original targets (denoising) or follow the new tokens;
masked positions can be dropped from the loss. The random numbers come from Philox keyed by
(seed, step, flat token index), so a run reproduces on any device and resumes exactly.

Tables (built once on the host, moved to the device once with ``.to(device)``):

- ``SynonymTable``: per-token CSR lists over the vocabulary, ``offsets`` int32 [V + 1] and
  ``candidates`` int32 [nnz]. ``build_synonym_table`` maps word -> synonyms data through a
  tokenizer: only words whose form is a single token count, for each variant a word takes in
  running text (bare ``word``, and after a space: byte-level BPE's ``Ġword``, SentencePiece's
  ``▁word``; optionally Title-case), and a synonym replaces a token of the same variant, so
  spacing and case survive a swap. ``coverage`` says what was kept and what was dropped, why.
- ``PosLexicon``: a tag id per token id (uint8 [V]; 0 = unknown, ``PROTECTED_TAG`` = special
  token), from word -> tag data (``build_pos_lexicon``) or a tagging function over the
  vocabulary (``pos_lexicon_from_function``).
- ``read_synonyms_tsv`` / ``read_pos_tsv`` load plain TSV files (``word<TAB>synonym<TAB>...``,
  ``word<TAB>TAG``; ``#`` comments); ``load_lexicon_dir`` reads ``synonyms.tsv`` + ``pos.tsv``.

Modules: ``tables`` (``SynonymTable``, ``PosLexicon``, ``CoverageReport``), ``tsv`` (the file
readers), ``lexicon`` (building the tables through a tokenizer), ``apply`` (``AugmentConfig``,
``augment``). They import downwards only: apply -> tables; lexicon -> tables, tsv; and all but
tsv -> ``ftlib.kernels`` (the tag constants, the op).

Use in a loop, after the batch reaches the device::

    syn, lex = load_lexicon_dir(tok, "lexicon/", vocab_size=model.config.vocab_size)
    print(syn.coverage.summary()); syn, lex = syn.to(device), lex.to(device)
    cfg = AugmentConfig(swap_prob=0.1, mask_prob=0.05, mask_token_id=tok.unk_token_id)
    for step, batch in enumerate(loader):
        batch = {k: v.to(device) for k, v in batch.items()}
        batch = augment(batch, syn, lex, cfg, seed=seed + rank, step=step)

Synonym swapping as augmentation: Wei & Zou 2019 (EDA); token masking as noise: Devlin et al.
2019 (BERT), Lewis et al. 2020 (BART's token masking).
"""

from ..kernels.augment_ref import PROTECTED_TAG
from .apply import AugmentConfig, augment
from .lexicon import (
    build_pos_lexicon,
    build_synonym_table,
    load_lexicon_dir,
    pos_lexicon_from_function,
    resolve_token_id,
    special_token_ids,
)
from .tables import CoverageReport, PosLexicon, SynonymTable
from .tsv import read_pos_tsv, read_synonyms_tsv

__all__ = [
    "AugmentConfig",
    "CoverageReport",
    "PROTECTED_TAG",
    "PosLexicon",
    "SynonymTable",
    "augment",
    "build_pos_lexicon",
    "build_synonym_table",
    "load_lexicon_dir",
    "pos_lexicon_from_function",
    "read_pos_tsv",
    "read_synonyms_tsv",
    "resolve_token_id",
    "special_token_ids",
]
