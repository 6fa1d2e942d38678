"""``ftlib.rl.kto_loss`` equals TRL's ``KTOTrainer`` loss and gradient on one fixed batch, in fp64.

TRL's own ``_compute_loss`` runs on a minimal trainer (``KTOTrainer.__new__``), with precomputed
reference log-probs (``precompute_ref_logps``) and the KL baseline on (``calculate_KL``: completions
rotated by one). Its model is the transformers twin of ftlib's tiny Llama behind a head that returns
fp64 per-token log-probs, entropy and mean logits from the full logits (TRL's fused head keeps fp32
statistics); ftlib runs the packed row of ``pack_kto`` through the chunked head. Desirable and
undesirable weights differ, labels are unbalanced, and the batch has uneven lengths.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from _fp64_twins import fp64_twins

from ftlib.models import LlamaForCausalLM
from ftlib.rl import KTOConfig, check_kto_records, kto_logps, kto_loss, pack_kto

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402

PROMPTS = [[5, 9, 11], [7, 2], [12, 30, 4, 8], [3, 3], [20, 21, 22]]
COMPLETIONS = [[3, 8, 1], [14, 2, 9, 33, 1], [6, 1], [40, 41, 1], [9, 1]]
LABELS = [True, False, True, True, False]
PAD = 0


class _Fp64Head(torch.nn.Module):
    """What TRL reads of ``model(..., labels=, fused_lm_head=True)``, from fp64 logits."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids, attention_mask, labels=None, fused_lm_head=False, **_):
        logits = self.hf(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        y = labels[:, 1:]
        mask = y != -100
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, y.clamp(min=0)[..., None])[..., 0] * mask
        ent = -(logp_all.exp() * logp_all).sum(-1) * mask
        return SimpleNamespace(log_probs=logp, entropy=ent, mean_logits=logits.mean(-1) * mask)


class _Acc:
    device = torch.device("cpu")
    num_processes = 1
    is_main_process = True

    def gather_for_metrics(self, x):
        return x

    def unwrap_model(self, m):
        return m


def _rows(prompts, completions):
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), PAD)
    am = torch.zeros_like(ids)
    cm = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        am[i, :n] = 1
        cm[i, len(p):n] = 1
    return ids, am, cm


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cfg, ours, hf = fp64_twins(tmp_path_factory.mktemp("kto_trl") / "base", head_scale=5.0)
    hf.eval()
    ref = LlamaForCausalLM(cfg).double()
    ref.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1 * p.abs().mean())
    return ours.double(), hf, ref


def test_kto_records_are_checked():
    check_kto_records([{"prompt": "a", "completion": "b", "label": True}])
    with pytest.raises(ValueError, match="record 1: missing field 'label'"):
        check_kto_records([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match="'label' must be true or false"):
        check_kto_records([{"prompt": "a", "completion": "b", "label": 1}])


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_and_gradient_equal_trl(models, loss_type):
    ours, hf, ref = models
    cfg = KTOConfig(beta=0.3, desirable_weight=1.0, undesirable_weight=1.5, loss_type=loss_type)
    batch = pack_kto(PROMPTS, COMPLETIONS, LABELS)
    assert batch["input_ids"].shape == (1, 2 * sum(len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS)))
    with torch.no_grad():
        ref_logps, ref_kl = kto_logps(ref, batch)
        if loss_type == "kto":  # lowered so that z0 = mean(policy - reference) on the mismatched pairs is > 0
            ref_kl = ref_kl - 2.0
    kl_completions = [COMPLETIONS[i - 1] for i in range(len(COMPLETIONS))]
    ids, am, cm = _rows(PROMPTS, COMPLETIONS)
    kids, kam, kcm = _rows(PROMPTS, kl_completions)
    inputs = {"input_ids": ids, "attention_mask": am, "completion_mask": cm, "KL_input_ids": kids,
              "KL_attention_mask": kam, "KL_completion_mask": kcm, "label": torch.tensor(LABELS),
              "ref_logps": ref_logps, "ref_KL_logps": ref_kl}
    model = _Fp64Head(hf).eval()
    t = KTOTrainer.__new__(KTOTrainer)
    t.__dict__.update(model=model, accelerator=_Acc(), calculate_KL=True, precompute_ref_logps=True,
                      aux_loss_enabled=False, loss_type=loss_type, beta=cfg.beta,
                      desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight,
                      _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
                      args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    try:
        trl_loss = t._compute_loss(model, inputs, return_outputs=False)
        trl_loss.backward()
        pol, pol_kl = kto_logps(ours, batch)
        out = kto_loss(pol, ref_logps, batch["label"], cfg, policy_kl_logps=pol_kl, reference_kl_logps=ref_kl)
        out.loss.backward()
        print(f"{loss_type}: z0 {float(out.kl):.4f} loss {float(out.loss):.6f} TRL {float(trl_loss):.6f} "
              f"|diff| {abs(float(out.loss) - float(trl_loss)):.2e}")
        assert abs(float(out.loss) - float(trl_loss)) <= 1e-12
        if loss_type == "kto":
            assert float(out.kl) > 0  # the baseline is in play (clamped at 0 otherwise)
        hf_grads = dict(hf.named_parameters())
        for name, p in ours.named_parameters():
            want = hf_grads[name].grad
            err = float((p.grad - want).abs().max()) / max(float(want.abs().max()), 1e-12)
            assert err <= 1e-10, (name, err)
        m = t._metrics["eval"]
        for key in ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins"):
            assert abs(out.stats[key] - m[key][-1]) <= 1e-9, (key, out.stats[key], m[key][-1])
    finally:
        hf.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
