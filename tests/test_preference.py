"""Preference tuning: sequence log-probs vs full logits, losses vs closed forms, packed == padded DPO,
the disabled-adapter reference == a frozen copy of the base, precomputed == on-the-fly reference."""

import copy
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data import CacheError
from ftlib.data.packing import PackPlan, pack
from ftlib.data.pair_batches import PairLoader, collate_pairs_packed, collate_pairs_padded, pair_tokens
from ftlib.lora import LoRAConfig, apply_lora, lora_layers
from ftlib.models import LlamaConfig, LlamaForCausalLM
from ftlib.preference import (
    LikelihoodDisplacementMonitor,
    LikelihoodDisplacementWarning,
    PairLogps,
    PreferenceLoss,
    pair_logps,
    precompute_reference,
    reference_pair_logps,
    sequence_logprobs,
)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- sequence log-probs -------------------------------------------------------------------------------
def _packed_docs(g, lengths, prompt_lens, vocab, t):
    """Rows of width t holding documents of `lengths`; labels on tokens after each prompt."""
    rows, row, cu, loss_start = [], [], [0], []
    for n, p in zip(lengths, prompt_lens):
        if len(row) + n > t:
            rows.append(row + [-1] * (t - len(row)))
            cu.append(len(rows) * t) if len(row) < t else None
            row = []
        loss_start.append((len(rows), len(row), len(row) + p, len(row) + n))
        row += torch.randint(0, vocab, (n,), generator=g).tolist()
        cu.append(len(rows) * t + len(row))
    rows.append(row + [-1] * (t - len(row)))
    if len(row) < t:
        cu.append(len(rows) * t)
    ids = torch.tensor(rows)
    labels = torch.full_like(ids, -100)
    for r, _, p, e in loss_start:
        labels[r, p:e] = ids[r, p:e]  # the response: tokens p..e-1; token p is predicted by p-1 (the prompt's last)
    ids[ids < 0] = 0
    return ids, labels, torch.tensor(cu, dtype=torch.int32), loss_start


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.tuples(st.integers(2, 40), st.integers(1, 30)), min_size=1, max_size=6),
       st.integers(1, 9))
def test_sequence_logprobs_equal_full_log_softmax_gather(seed, docs, chunk):
    """Invariant: per document, sum/count of log_softmax(h W^T)[t-1, y_t] over its response tokens —
    including the first one, predicted from the prompt's last token — equal the chunked op's values, and
    so do the gradients w.r.t. hidden states and head (float64, documents of very different lengths)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [p + r for p, r in docs]
    prompts = [p for p, _ in docs]
    t = max(max(lengths), 48)
    vocab, hdim = 23, 6
    ids, labels, cu, spans = _packed_docs(g, lengths, prompts, vocab, t)
    hidden = torch.randn(ids.shape[0], t, hdim, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hdim, generator=g, dtype=torch.float64, requires_grad=True)
    seq = sequence_logprobs(hidden, weight, labels, cu_seqlens=cu, chunk_size=chunk)
    coef = torch.randn(seq.sum.shape, generator=g, dtype=torch.float64)
    gh, gw = torch.autograd.grad((seq.sum * coef).sum(), (hidden, weight))

    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)  # (B, T, V) full logits: the reference
    want, want_n = [], []
    for r, _, p, e in spans:
        pos = torch.arange(p, e)
        want.append(logp[r, pos - 1, ids[r, pos]].sum())  # position p is predicted by p - 1
        want_n.append(e - p)
    doc_of_span = [int(torch.searchsorted(cu.long(), r * t + p, right=True)) - 1 for r, _, p, _ in spans]
    torch.testing.assert_close(seq.sum[doc_of_span], torch.stack(want), rtol=1e-10, atol=1e-10)
    assert seq.count[doc_of_span].tolist() == want_n
    others = [d for d in range(len(seq.sum)) if d not in doc_of_span]  # padding tails: nothing
    assert seq.sum[others].abs().sum() == 0 and seq.count[others].sum() == 0
    ref = torch.stack(want) @ coef[doc_of_span]
    rh, rw = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(gh, rh, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(gw, rw, rtol=1e-9, atol=1e-11)


def test_prompt_boundary_token_is_counted():
    """The first response token is scored from the last prompt token: its log-prob alone is the answer."""
    hidden = torch.zeros(1, 5, 2, dtype=torch.float64)
    hidden[0, 2] = torch.tensor([1.0, 0.0])  # the last prompt token (position 2)
    weight = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([[-100, -100, -100, 1, -100]])  # response = token 3 only
    seq = sequence_logprobs(hidden, weight, labels)
    want = 3.0 - math.log(math.exp(3.0) + 2.0)
    assert seq.count.tolist() == [1] and abs(float(seq.sum[0]) - want) < 1e-12


def test_sequence_logprobs_rows_and_errors():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 4, generator=g)
    weight = torch.randn(11, 4, generator=g)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[1] = -100
    seq = sequence_logprobs(hidden, weight, labels, chunk_size=2)
    full = torch.log_softmax(hidden @ weight.t(), -1)[:, :-1].gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    want = (full * (labels[:, 1:] != -100)).sum(1)
    torch.testing.assert_close(seq.sum, want, rtol=1e-5, atol=1e-5)
    assert seq.count.tolist() == [6, 0, 6] and seq.mean[1] == 0
    with pytest.raises(ValueError, match=r"labels must be in \[0, 11\)"):
        sequence_logprobs(hidden, weight, labels.masked_fill(labels >= 0, 11))
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D from 0 to B\\*T=21"):
        sequence_logprobs(hidden, weight, labels, cu_seqlens=torch.tensor([0, 7, 14], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be an integer tensor.*float32"):  # was truncated
        sequence_logprobs(hidden, weight, labels, cu_seqlens=torch.tensor([0, 7.5, 21]))
    with pytest.raises(ValueError, match="lm_head_weight must be"):
        sequence_logprobs(hidden, weight.t(), labels)


# ---- losses vs closed forms -----------------------------------------------------------------------
def _logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


logp = st.floats(-80.0, -0.01)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(logp, logp, logp, logp, st.integers(1, 50), st.integers(1, 50)), min_size=1, max_size=5),
       st.floats(0.01, 5.0), st.floats(0.0, 0.45), st.floats(0.0, 2.0))
def test_losses_equal_closed_forms(rows, beta, eps, gamma):
    """Invariant: every loss kind equals its formula evaluated in plain float arithmetic, per pair, on
    hand-made log-probs (sums; means = sum / response length), and the logged rewards/margins/accuracies
    follow the definitions."""
    pc, pr, rc, rr, nc, nr = (torch.tensor([r[i] for r in rows], dtype=torch.float64) for i in range(6))
    nc, nr = nc.long(), nr.long()
    policy, ref = PairLogps(pc, pr, nc, nr), PairLogps(rc, rr, nc, nr)
    for kind in ("sigmoid", "robust", "ipo", "hinge", "simpo", "orpo"):
        ls = eps if kind in ("sigmoid", "robust", "simpo") else 0.0
        out = PreferenceLoss(kind, beta=beta, label_smoothing=ls, gamma=gamma)(policy, ref)
        for i, (a, b, c, d, n1, n2) in enumerate(rows):
            if kind in ("ipo", "simpo", "orpo"):  # length-normalised by definition / by default
                a, b, c, d = a / n1, b / n2, c / n1, d / n2
            delta = (a - b) - (c - d)
            h = beta * delta
            if kind == "sigmoid":
                want = -(1 - ls) * _logsig(h) - ls * _logsig(-h)
            elif kind == "robust":
                want = (-(1 - ls) * _logsig(h) + ls * _logsig(-h)) / (1 - 2 * ls)
            elif kind == "ipo":
                want = (delta - 1 / (2 * beta)) ** 2
            elif kind == "hinge":
                want = max(0.0, 1 - h)
            elif kind == "simpo":
                z = beta * (a - b) - gamma
                want = -(1 - ls) * _logsig(z) - ls * _logsig(-z)
            else:
                odds = lambda x: x - math.log(1 - math.exp(x))
                want = -a - beta * _logsig(odds(a) - odds(b))
            assert abs(float(out.losses[i]) - want) <= 1e-9 * max(1.0, abs(want)), (kind, i, float(out.losses[i]), want)
            if kind in ("simpo", "orpo"):
                wc, wr = beta * a, beta * b
            else:
                wc, wr = beta * (a - c), beta * (b - d)
            assert abs(float(out.chosen_rewards[i]) - wc) < 1e-9 and abs(float(out.rejected_rewards[i]) - wr) < 1e-9
            assert abs(float(out.margins[i]) - (wc - wr)) < 1e-9
            assert float(out.accuracies[i]) == float(wc > wr)


def test_loss_gradients_are_the_dpo_weights():
    """d(-log sigma(beta delta))/d pi_c = -beta sigma(-beta delta): the DPO per-pair weight."""
    pc = torch.tensor([-3.0, -9.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-4.0, -2.0], dtype=torch.float64)
    rc, rr = torch.tensor([-3.5, -5.0], dtype=torch.float64), torch.tensor([-3.5, -5.0], dtype=torch.float64)
    n = torch.ones(2, dtype=torch.long)
    out = PreferenceLoss("sigmoid", beta=0.5)(PairLogps(pc, pr, n, n), PairLogps(rc, rr, n, n))
    (g,) = torch.autograd.grad(out.losses.sum(), pc)
    delta = (pc - pr).detach()
    torch.testing.assert_close(g, -0.5 * torch.sigmoid(-0.5 * delta))


def test_loss_config_errors():
    n = torch.ones(1, dtype=torch.long)
    x = PairLogps(torch.tensor([-1.0]), torch.tensor([-2.0]), n, n)
    with pytest.raises(ValueError, match="unknown preference loss 'kto'"):
        PreferenceLoss("kto")
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 0.5\\) for robust"):
        PreferenceLoss("robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="does not apply to the ipo loss"):
        PreferenceLoss("ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta must be > 0"):
        PreferenceLoss(beta=0.0)
    with pytest.raises(ValueError, match="needs reference log-probs"):
        PreferenceLoss("sigmoid")(x)
    with pytest.raises(ValueError, match="length_normalize=False refused"):
        PreferenceLoss("simpo", length_normalize=False)
    other = PairLogps(torch.tensor([-1.0]), torch.tensor([-2.0]), n + 1, n)
    with pytest.raises(ValueError, match="different response tokens"):
        PreferenceLoss()(x, other)
    free = PreferenceLoss("sigmoid", reference_free=True)(x)
    torch.testing.assert_close(free.losses, F.softplus(torch.tensor([-0.1])))
    assert not PreferenceLoss("orpo").needs_reference and PreferenceLoss("hinge").needs_reference


def _closed_form(kind, a, b, c, d, beta, ls, gamma):
    """The loss of one pair in plain floats, on the values the kind uses (sums or means)."""
    delta = (a - b) - (c - d)
    h = beta * delta
    if kind == "sigmoid":
        return -(1 - ls) * _logsig(h) - ls * _logsig(-h)
    if kind == "robust":
        return (-(1 - ls) * _logsig(h) + ls * _logsig(-h)) / (1 - 2 * ls)
    if kind == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    if kind == "hinge":
        return max(0.0, 1 - h)
    z = beta * (a - b) - gamma  # simpo
    return -(1 - ls) * _logsig(z) - ls * _logsig(-z)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(logp, logp, logp, logp, st.integers(1, 50), st.integers(1, 50)), min_size=1, max_size=5),
       st.floats(0.01, 5.0), st.floats(0.0, 0.45), st.floats(0.0, 2.0), st.floats(0.0, 3.0))
def test_rpo_equals_closed_form(rows, beta, eps, gamma, alpha):
    """Invariant: with rpo_alpha = α every kind but orpo adds α · (-π_c / n_c) — the chosen response's NLL
    per token, from the summed log-prob even where the loss uses means — to its closed form; the logged
    rewards are unchanged and ``nll_loss`` is the mean NLL. On a batch whose chosen responses share one
    length the mean loss equals TRL's: mean(DPO) + α · (token mean of the chosen NLL over the batch)."""
    pc, pr, rc, rr, nc, nr = (torch.tensor([r[i] for r in rows], dtype=torch.float64) for i in range(6))
    nc, nr = nc.long(), nr.long()
    policy, ref = PairLogps(pc, pr, nc, nr), PairLogps(rc, rr, nc, nr)
    for kind in ("sigmoid", "robust", "ipo", "hinge", "simpo"):
        ls = eps if kind in ("sigmoid", "robust", "simpo") else 0.0
        out = PreferenceLoss(kind, beta=beta, label_smoothing=ls, gamma=gamma, rpo_alpha=alpha)(policy, ref)
        plain = PreferenceLoss(kind, beta=beta, label_smoothing=ls, gamma=gamma)(policy, ref)
        for i, (a, b, c, d, n1, n2) in enumerate(rows):
            v = (a / n1, b / n2, c / n1, d / n2) if kind in ("ipo", "simpo") else (a, b, c, d)
            want = _closed_form(kind, *v, beta, ls, gamma) + alpha * (-a / n1)
            assert abs(float(out.losses[i]) - want) <= 1e-9 * max(1.0, abs(want)), (kind, i, float(out.losses[i]), want)
            assert abs(float(out.nll[i]) - (-a / n1)) <= 1e-12 * max(1.0, abs(a))
        torch.testing.assert_close(out.chosen_rewards, plain.chosen_rewards, rtol=0, atol=0)
        assert abs(out.stats()["nll_loss"] - sum(-a / n1 for a, _, _, _, n1, _ in rows) / len(rows)) < 1e-9
    # TRL's value when the chosen lengths are equal: losses.mean() + rpo_alpha * nll over all chosen tokens
    n = torch.full_like(nc, int(nc[0]))
    out = PreferenceLoss("sigmoid", beta=beta, rpo_alpha=alpha)(PairLogps(pc, pr, n, nr), PairLogps(rc, rr, n, nr))
    trl = sum(_closed_form("sigmoid", a, b, c, d, beta, 0.0, 0.0) for a, b, c, d, *_ in rows) / len(rows) \
        + alpha * float(-pc.sum() / n.sum())
    assert abs(float(out.losses.mean()) - trl) <= 1e-9 * max(1.0, abs(trl))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(logp, logp, logp, logp, st.integers(1, 50), st.integers(1, 50)), min_size=1, max_size=5),
       st.floats(0.01, 5.0), st.floats(0.0, 0.45), st.floats(0.0, 60.0), st.booleans())
def test_dpop_equals_closed_form(rows, beta, eps, lam, normalize):
    """Invariant (Smaug, eq. 3): with dpop_lambda = λ the reference-based kinds score
    Δ' = Δ - λ · max(0, ρ_c - π_c) in place of Δ; λ = 0, or a chosen log-prob at or above the
    reference's, leaves the loss as it was."""
    pc, pr, rc, rr, nc, nr = (torch.tensor([r[i] for r in rows], dtype=torch.float64) for i in range(6))
    nc, nr = nc.long(), nr.long()
    policy, ref = PairLogps(pc, pr, nc, nr), PairLogps(rc, rr, nc, nr)
    for kind in ("sigmoid", "robust", "ipo", "hinge"):
        ls = eps if kind in ("sigmoid", "robust") else 0.0
        out = PreferenceLoss(kind, beta=beta, label_smoothing=ls, dpop_lambda=lam, length_normalize=normalize)(policy, ref)
        for i, (a, b, c, d, n1, n2) in enumerate(rows):
            if normalize:
                a, b, c, d = a / n1, b / n2, c / n1, d / n2
            pen = lam * max(0.0, c - a)
            # Δ' = (a - b) - (c - d) - pen: fold the penalty into the reference's chosen value
            want = _closed_form(kind, a, b, c + pen, d, beta, ls, 0.0)
            assert abs(float(out.losses[i]) - want) <= 1e-9 * max(1.0, abs(want)), (kind, i, float(out.losses[i]), want)
            if pen == 0.0:
                plain = PreferenceLoss(kind, beta=beta, label_smoothing=ls, length_normalize=normalize)(policy, ref)
                assert float(out.losses[i]) == float(plain.losses[i])


def test_dpop_and_rpo_gradients():
    """d/dπ_c of the sigmoid loss: -β σ(-βΔ') (1 + λ [π_c < ρ_c]) - α / n_c."""
    pc = torch.tensor([-3.0, -9.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-4.0, -12.0], dtype=torch.float64)
    rc, rr = torch.tensor([-3.5, -5.0], dtype=torch.float64), torch.tensor([-3.5, -6.0], dtype=torch.float64)
    nc, nr = torch.tensor([2, 5]), torch.tensor([3, 3])
    beta, lam, alpha = 0.5, 4.0, 0.7
    out = PreferenceLoss("sigmoid", beta=beta, dpop_lambda=lam, rpo_alpha=alpha)(PairLogps(pc, pr, nc, nr),
                                                                                 PairLogps(rc, rr, nc, nr))
    (g,) = torch.autograd.grad(out.losses.sum(), pc)
    below = (pc < rc).double().detach()
    delta = (pc - pr - (rc - rr)).detach() - lam * torch.relu(rc - pc.detach())
    want = -beta * torch.sigmoid(-beta * delta) * (1 + lam * below) - alpha / nc.double()
    torch.testing.assert_close(g, want)
    assert below.tolist() == [0.0, 1.0]  # one pair on each side of the reference


def test_guard_config_errors_and_stats_names():
    with pytest.raises(ValueError, match="rpo_alpha does not apply to orpo"):
        PreferenceLoss("orpo", rpo_alpha=1.0)
    with pytest.raises(ValueError, match="rpo_alpha must be"):
        PreferenceLoss(rpo_alpha=-1.0)
    with pytest.raises(ValueError, match="dpop_lambda needs reference log-probs"):
        PreferenceLoss("simpo", dpop_lambda=5.0)
    with pytest.raises(ValueError, match="dpop_lambda needs reference log-probs"):
        PreferenceLoss("sigmoid", reference_free=True, dpop_lambda=5.0)
    with pytest.raises(ValueError, match="dpop_lambda must be"):
        PreferenceLoss(dpop_lambda=float("nan"))
    n = torch.tensor([2, 4])
    pol = PairLogps(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0]), n, n)
    ref = PairLogps(torch.tensor([-1.5, -2.0]), torch.tensor([-1.0, -2.5]), n, n)
    st_ = PreferenceLoss(beta=0.5, rpo_alpha=1.0)(pol, ref).stats()
    assert sorted(st_) == ["logps/chosen", "logps/rejected", "loss", "n_pairs", "nll_loss", "rewards/accuracies",
                           "rewards/chosen", "rewards/margins", "rewards/rejected"]
    assert st_["logps/chosen"] == -2.0 and st_["logps/rejected"] == -2.0 and st_["nll_loss"] == (0.5 + 0.75) / 2
    assert st_["rewards/chosen"] == 0.5 * (0.5 - 1.0) / 2 and st_["rewards/margins"] == st_["rewards/chosen"] - st_["rewards/rejected"]


# ---- likelihood displacement ------------------------------------------------------------------------------
def _feed(monitor, chosen, margin):
    return [monitor.update({"logps/chosen": c, "rewards/margins": m}) for c, m in zip(chosen, margin)]


def test_displacement_warning_when_chosen_falls_while_margin_grows():
    """The textbook displacement curve (chosen log-prob drifting down, margin up, with step noise) warns in
    each window; the same noise around flat or rising chosen log-probs, or a falling margin, never does."""
    g = np.random.default_rng(0)
    steps = 120
    noise = lambda: g.normal(0, 0.4, steps)
    down, up = -5 - 0.05 * np.arange(steps) + noise(), 0.05 * np.arange(steps) + noise()
    mon = LikelihoodDisplacementMonitor(window=30)
    with pytest.warns(LikelihoodDisplacementWarning, match="chosen log-prob fell"):
        msgs = _feed(mon, down, up)
    fired = [i for i, m in enumerate(msgs) if m]
    # windows of 30 steps, each tested once: warned at the end of a window, in most of them
    assert fired[0] == 29 and set(fired) <= {29, 59, 89, 119} and len(fired) >= 3 and mon.fired == len(fired)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", LikelihoodDisplacementWarning)
        for chosen, margin in ((-5 + 0.05 * np.arange(steps) + noise(), up),  # chosen rises: healthy DPO
                               (-5 + noise(), up),  # flat chosen: noise only
                               (down, -0.05 * np.arange(steps) + noise()),  # both fall: no margin growth
                               (-5 - 0.001 * np.arange(steps), up)):  # a steady but tiny fall (< min_drop)
            assert not any(_feed(LikelihoodDisplacementMonitor(window=30), chosen, margin))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-50, 0), min_size=4, max_size=60), st.lists(st.floats(-5, 5), min_size=60, max_size=60))
def test_displacement_never_warns_on_rising_chosen_logps(chosen, margin):
    """Invariant: a non-decreasing chosen log-prob sequence never warns, whatever the margins do."""
    chosen = sorted(chosen)
    mon = LikelihoodDisplacementMonitor(window=4, min_drop=0.0, t=0.0, warn=False)
    assert not any(_feed(mon, chosen, margin))


def test_displacement_monitor_state_round_trip():
    g = np.random.default_rng(1)
    down, up = -5 - 0.1 * np.arange(40) + g.normal(0, 0.1, 40), 0.1 * np.arange(40)
    a, b = LikelihoodDisplacementMonitor(window=25, warn=False), LikelihoodDisplacementMonitor(window=25, warn=False)
    _feed(a, down[:20], up[:20])
    b.load_state_dict(a.state_dict())  # what a resume does
    assert _feed(a, down[20:], up[20:]) == _feed(b, down[20:], up[20:])
    assert a.fired == b.fired == 1 and len(b.chosen) == 40 - 25
    with pytest.raises(ValueError, match="window must be >= 4"):
        LikelihoodDisplacementMonitor(window=3)


# ---- pair batches through a model -----------------------------------------------------------------
class _Pairs:
    """A PairCache stand-in: explicit (prompt, chosen, rejected) token lists."""

    def __init__(self, g, shapes, vocab):
        self.items = []
        for p, c, r in shapes:
            mk = lambda n: np.asarray(torch.randint(3, vocab, (n,), generator=g).tolist(), dtype=np.int64)
            self.items.append((mk(p), mk(c), mk(r)))
        self.effective_margin = np.full(len(shapes), np.nan)
        self.reference = None
        self.prompt_len = np.array([p for p, _, _ in shapes])
        self.chosen_len = np.array([c for _, c, _ in shapes])
        self.rejected_len = np.array([r for _, _, r in shapes])
        self.path = "<test>"

    def __len__(self):
        return len(self.items)

    @property
    def side_lengths(self):
        return self.prompt_len + self.chosen_len, self.prompt_len + self.rejected_len

    def sequence(self, i, side):
        p, c, r = self.items[i]
        s = c if side == "chosen" else r
        mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(s), np.uint8)])
        mask[-1] = 0  # a trailing no-loss token, like the "\n" after a chat turn end
        return np.concatenate([p, s]), mask


def _tiny_model(seed=0, vocab=61, model_type="llama"):
    torch.manual_seed(seed)
    extra = dict(qkv_bias=True, tie_word_embeddings=True) if model_type == "qwen2" else {}
    cfg = LlamaConfig(model_type=model_type, vocab_size=vocab, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      **extra)
    return LlamaForCausalLM(cfg)


def _adapted(model, seed=1):
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="all-linear"), verbose=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):  # a trained-looking adapter: B != 0
            layer.lora_B.weight.copy_(0.3 * torch.randn(layer.lora_B.weight.shape, generator=g))
    return model


SHAPES = [(3, 2, 9), (17, 5, 1), (1, 30, 4), (8, 8, 8), (25, 2, 3), (2, 1, 1)]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: qkv biases, tied embeddings
def test_packed_and_padded_dpo_give_the_same_loss_and_gradients(model_type):
    """Same pairs, same model: the packed layout (both sides in one row, cu_seqlens) and the padded one
    (2P rows, attention_mask) give the same per-pair log-probs, loss and LoRA gradients (fp32, tight)."""
    g = torch.Generator().manual_seed(0)
    pairs = _Pairs(g, SHAPES, 61)
    model = _adapted(_tiny_model(model_type=model_type))
    sc, sr = pairs.side_lengths
    plan = pack(sc + sr, 64, "truncate")
    packed = collate_pairs_packed(pairs, plan, range(plan.n_rows), pad_id=0)
    padded = collate_pairs_padded(pairs, packed["pair_ids"].numpy(), pad_id=0)  # the same pair order
    assert plan.n_rows < len(SHAPES) and packed["input_ids"].numel() < padded["input_ids"].numel()
    loss_fn = PreferenceLoss("sigmoid", beta=0.5)
    results = []
    for batch in (packed, padded):
        model.zero_grad()
        ref = reference_pair_logps(model, batch)
        pol = pair_logps(model, batch, chunk_size=7)
        out = loss_fn(pol, ref)
        out.losses.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((pol, ref, out.losses.detach(), grads))
    (p1, r1, l1, g1), (p2, r2, l2, g2) = results
    for a, b in ((p1.chosen, p2.chosen), (p1.rejected, p2.rejected), (r1.chosen, r2.chosen), (l1, l2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # every response token but the trailing no-loss one is scored, the first one included
    assert torch.equal(p1.chosen_n, p2.chosen_n)
    assert p1.chosen_n.tolist() == [int(c) - 1 for c in pairs.chosen_len[packed["pair_ids"].numpy()]]
    assert (p1.chosen - r1.chosen).abs().max() > 1e-2, "the adapter changed nothing: the check would be vacuous"
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)


def _flat_batch(pairs, pair_ids):
    """The pairs in one row exactly as long as their tokens (no padding), through collate_pairs_packed."""
    sc, sr = pairs.side_lengths
    ids = np.asarray(pair_ids, dtype=np.int64)
    length = (sc[ids] + sr[ids]).astype(np.int64)
    plan = PackPlan(seq_len=int(length.sum()), row_ptr=np.array([0, len(ids)]), doc=ids,
                    start=np.zeros(len(ids), np.int64), length=length, stats=None)
    return collate_pairs_packed(pairs, plan, [0], pad_id=0)


@pytest.mark.parametrize("num_workers,trim", [(0, False), (1, False), (0, True), (1, True)])
def test_pair_loader_steps_give_the_flat_layouts_losses(num_workers, trim):
    """The PairLoader path (several padded-tail rows a step, as examples/dpo.py and bench_dpo run it) gives
    every pair the loss of the same pairs laid flat in one padding-free row, and pair_tokens counts the
    same real tokens in both (both sides of every pair, no padding). With ``trim_padding`` the batch IS
    the flat layout: one row of exactly the pairs' tokens, the same tensors."""
    g = torch.Generator().manual_seed(3)
    shapes = [tuple(int(x) for x in torch.randint(1, 12, (3,), generator=g)) for _ in range(14)]
    pairs = _Pairs(g, shapes, 61)
    model = _adapted(_tiny_model())
    sc, sr = pairs.side_lengths
    loader = PairLoader(pairs, batch_size=2, pad_id=0, seq_len=48, seed=1, drop_last=False, num_workers=num_workers,
                        trim_padding=trim)
    untrimmed = PairLoader(pairs, batch_size=2, pad_id=0, seq_len=48, seed=1, drop_last=False)
    loss_fn = PreferenceLoss("sigmoid", beta=0.5)
    seen, padded_steps = [], 0
    with torch.no_grad():
        for batch, full in zip(loader, untrimmed):
            ids = batch["pair_ids"].numpy()
            flat = _flat_batch(pairs, ids)
            padded_steps += int(full["input_ids"].numel() > flat["input_ids"].numel())
            if trim:
                for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "chosen_index", "rejected_index"):
                    assert torch.equal(batch[key], flat[key]), key
                assert batch["max_seqlen"] == flat["max_seqlen"]
            assert pair_tokens(batch) == pair_tokens(flat) == int((sc[ids] + sr[ids]).sum())
            out = [loss_fn(pair_logps(model, b, chunk_size=5), reference_pair_logps(model, b)).losses
                   for b in (batch, flat)]
            torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-6)
            seen += ids.tolist()
    assert sorted(seen) == list(range(len(shapes)))
    assert padded_steps and len(loader) > 2, "no step with padding or several rows: the check would be vacuous"


def test_disabled_adapter_reference_equals_frozen_base_copy():
    """reference_pair_logps(model with adapters) == pair_logps(a separate frozen copy of the base)."""
    g = torch.Generator().manual_seed(3)
    pairs = _Pairs(g, SHAPES, 61)
    base = _tiny_model(seed=5)
    frozen = copy.deepcopy(base).requires_grad_(False).eval()
    model = _adapted(base, seed=7)
    sc, sr = pairs.side_lengths
    plan = pack(sc + sr, 80, "truncate")
    batch = collate_pairs_packed(pairs, plan, range(plan.n_rows), pad_id=0)
    ref = reference_pair_logps(model, batch)
    with torch.no_grad():
        want = pair_logps(frozen, batch)
        policy = pair_logps(model, batch)
    assert torch.equal(ref.chosen, want.chosen) and torch.equal(ref.rejected, want.rejected)
    assert torch.equal(ref.chosen_n, want.chosen_n)
    assert (policy.chosen - want.chosen).abs().max() > 1e-2  # the adapter is on outside the context
    assert all(not layer.disabled for _, layer in lora_layers(model))  # and back on after it
    via_arg = reference_pair_logps(model, batch, reference_model=frozen)
    assert torch.equal(via_arg.chosen, want.chosen)
    with pytest.raises(ValueError, match="no adapters to disable"):
        reference_pair_logps(frozen, batch)


def test_precomputed_reference_equals_on_the_fly(tokenizer_and_pairs):
    """precompute_reference stores per-pair values that equal the adapters-off pass, and loader batches
    carry them so no reference pass is needed; a reference from another cache is refused."""
    from ftlib.data.pair_batches import PairLoader
    from ftlib.data.pairs import PairCache

    cache, other = tokenizer_and_pairs
    model = _adapted(_tiny_model(vocab=400), seed=2)
    precompute_reference(model, cache, "base", pad_id=0, seq_len=128, batch_size=2, progress=False)
    assert cache.reference is not None and cache.reference["chosen"].shape == (len(cache),)
    loader = PairLoader(cache, batch_size=2, pad_id=0, seq_len=128, seed=1)
    for batch in loader:
        assert "ref_chosen" in batch
        stored = reference_pair_logps(model, batch)
        plain = {k: v for k, v in batch.items() if not k.startswith("ref_")}
        fresh = reference_pair_logps(model, plain)
        torch.testing.assert_close(stored.chosen, fresh.chosen, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(stored.rejected, fresh.rejected, rtol=1e-5, atol=1e-4)
        assert torch.equal(stored.chosen_n, fresh.chosen_n) and torch.equal(stored.rejected_n, fresh.rejected_n)
    reopened = PairCache(cache.path, reference="base")
    assert np.array_equal(reopened.reference["chosen"], cache.reference["chosen"])
    os.makedirs(os.path.dirname(other.reference_path("x")), exist_ok=True)
    shutil.copy(cache.reference_path("base"), other.reference_path("x"))  # another cache's file
    with pytest.raises(CacheError, match="computed for another cache"):
        other.load_reference("x")
    with pytest.raises(FileNotFoundError, match="no precomputed reference"):
        cache.load_reference("missing")


@pytest.fixture
def tokenizer_and_pairs(tmp_path):
    """Two small pair caches (different records) built with a tiny trained tokenizer."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ftlib.data.pairs import PairConfig, build_pair_cache

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"],
                             show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["what is one plus two", "three is the answer", "the sky is blue"] * 20, tr)
    cfg = PairConfig(chat_template="chatml", eos_token="<|im_end|>", max_length=60)
    out = []
    for name, k in (("a", 9), ("b", 4)):
        recs = [{"prompt": f"what is {i} plus {i + 1}" + " really" * (i % 5), "chosen": f"{2 * i + 1} is the answer",
                 "rejected": "the sky is blue" + " blue" * (i % 3)} for i in range(k)]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        out.append(build_pair_cache(str(path), tok, cfg, str(tmp_path / f"cache_{name}"), progress=False))
    return out


@pytest.mark.gpu
def test_packed_equals_padded_on_cuda_bf16():
    """On CUDA (fused varlen attention) under bf16 autocast, packed and padded DPO agree to bf16 rounding,
    and the chunked log-probs stay close to the fp64 full-logits values."""
    g = torch.Generator().manual_seed(0)
    pairs = _Pairs(g, SHAPES, 61)
    model = _adapted(_tiny_model()).cuda()
    sc, sr = pairs.side_lengths
    plan = pack(sc + sr, 64, "truncate")
    packed = collate_pairs_packed(pairs, plan, range(plan.n_rows), pad_id=0)
    padded = collate_pairs_padded(pairs, packed["pair_ids"].numpy(), pad_id=0)
    outs = []
    for batch in (packed, padded):
        batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pol = pair_logps(model, batch)
        ref = reference_pair_logps(model, batch, autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        outs.append(PreferenceLoss(beta=0.5)(pol, ref).losses.float().cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    hidden = model.model(packed["input_ids"].cuda(), position_ids=packed["position_ids"].cuda(),
                         cu_seqlens=packed["cu_seqlens"].cuda(), max_seqlen=packed["max_seqlen"]).detach()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        seq = sequence_logprobs(hidden, model.lm_head.weight, packed["labels"].cuda(), cu_seqlens=packed["cu_seqlens"].cuda())
    full = sequence_logprobs(hidden.double(), model.lm_head.weight.double(), packed["labels"].cuda(),
                             cu_seqlens=packed["cu_seqlens"].cuda())
    torch.testing.assert_close(seq.sum.double(), full.sum, rtol=2e-2, atol=5e-2)


@pytest.mark.distributed
def test_precompute_reference_on_two_ranks(tmp_path, tokenizer_and_pairs):
    """Under torchrun each rank computes part of the pairs; the file holds every pair's value, equal to
    one process's pass, and both ranks attach the same reference."""
    from _torchrun import run_torchrun

    cache, _ = tokenizer_and_pairs
    (tmp_path / "cache").write_text(cache.path)
    run_torchrun(Path(__file__).parent / "_dist_pairs_worker.py", tmp_path, timeout=300)


@pytest.mark.parametrize("temperature, softcap", [(1.0, None), (0.7, None), (1.0, 3.0), (0.7, 3.0), (1.6, 2.0)])
def test_token_logprobs_with_temperature_and_softcap_equal_float64_logits(temperature, softcap):
    # log softmax(c tanh(W h / c) / T)[y]: the value, the entropy and both gradients against full
    # float64 logits; chunk 3 over 7 targets so the blocks do not divide the tokens
    from ftlib.preference import token_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 6, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, 1] = labels[1, 3] = -100
    out = token_logprobs(h, w, labels, chunk_size=3, temperature=temperature, softcap=softcap, entropy=True)
    z = h[:, :-1].reshape(-1, 6) @ w.t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    y = labels[:, 1:].reshape(-1)
    keep = y != -100
    ref = logp_all[keep].gather(1, y[keep, None]).squeeze(1)
    ref_entropy = -(logp_all.exp() * logp_all).sum(-1)[keep]
    torch.testing.assert_close(out.logp, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.entropy, ref_entropy.detach(), rtol=1e-12, atol=1e-12)
    gh, gw = torch.autograd.grad(out.logp.sum(), (h, w))
    rh, rw = torch.autograd.grad(ref.sum(), (h, w))
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)
