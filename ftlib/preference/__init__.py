"""Preference tuning: sequence log-probabilities without full logits, the DPO family of losses, reference
log-probabilities that need no second model, and a watch for likelihood displacement.

    from ftlib.preference import PreferenceLoss, pair_logps, reference_pair_logps
    loss_fn = PreferenceLoss("sigmoid", beta=0.1)
    out = loss_fn(pair_logps(model, batch), reference_pair_logps(model, batch))   # per pair
    opt.backward(out.losses.sum(), n_pairs)

Modules (each with its math and references):

- ``logprobs``   ``token_logprobs`` / ``sequence_logprobs`` (the chunked projection: one [chunk, V]
                 block at a time, recomputed in backward) and ``pair_logps`` for a pair batch
                 (``PairPolicy``: the same as a module, the one DDP wraps);
- ``reference``  ``reference_pair_logps`` (adapters disabled, a frozen model, or the values the
                 pair cache carries) and ``precompute_reference`` (that pass once, into the cache);
- ``losses``     sigmoid (DPO), robust, ipo, hinge, simpo, orpo, with RPO and DPOP
                 (``PreferenceLoss``, ``PreferenceOutput``; the per-pair loss functions);
- ``monitor``    ``LikelihoodDisplacementMonitor``: warns when the chosen log-probs fall steadily
                 while the margin grows.
"""

from .logprobs import (
    PairLogps,
    PairPolicy,
    SequenceLogprobs,
    TokenLogprobs,
    pair_logps,
    sequence_logprobs,
    token_logprobs,
)
from .losses import (
    LOSS_KINDS,
    PreferenceLoss,
    PreferenceOutput,
    dpo_sigmoid_loss,
    dpop_penalty,
    hinge_loss,
    ipo_loss,
    orpo_loss,
    robust_dpo_loss,
    rpo_nll,
    simpo_loss,
)
from .monitor import LikelihoodDisplacementMonitor, LikelihoodDisplacementWarning
from .reference import precompute_reference, reference_pair_logps

__all__ = [
    "LOSS_KINDS",
    "LikelihoodDisplacementMonitor",
    "LikelihoodDisplacementWarning",
    "PairLogps",
    "PairPolicy",
    "PreferenceLoss",
    "PreferenceOutput",
    "SequenceLogprobs",
    "TokenLogprobs",
    "dpo_sigmoid_loss",
    "dpop_penalty",
    "hinge_loss",
    "ipo_loss",
    "orpo_loss",
    "pair_logps",
    "precompute_reference",
    "reference_pair_logps",
    "robust_dpo_loss",
    "rpo_nll",
    "sequence_logprobs",
    "simpo_loss",
    "token_logprobs",
]
