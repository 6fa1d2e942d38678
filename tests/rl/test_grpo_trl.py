"""``ftlib.rl.grpo_loss`` equals TRL's ``GRPOTrainer`` loss and gradient on one fixed batch, in fp64.

The same tiny Llama twice: ftlib's (packed rows, chunked head) and its transformers twin, which TRL's
own ``_compute_loss`` runs on a minimal trainer (``GRPOTrainer.__new__`` with the attributes that
method reads). TRL 1.16's fused LM head keeps its softmax statistics in fp32 whatever the model's
dtype, so for the fp64 comparison the trainer's per-token log-probs come from TRL's own unfused
pieces (``selective_log_softmax`` / ``entropy_from_logits`` on the fp64 logits divided by the
temperature, what GRPOTrainer computed before the fused head, with positions counted from each
prompt's first real token, and transformers' RMSNorm run in fp64 instead of its fixed fp32); the
fused head is checked against ftlib's log-probs at fp32 accuracy. Prompts of uneven lengths (left-padded for TRL), completions of uneven
lengths (right-padded), rewards -> ``group_advantages`` (checked against TRL's formula), sampling
temperature 0.7. μ = 1: π_old = π_θ detached; μ = 2: π_old taken, then the weights of both models
moved by the same step, so ratios leave [1 - ε_low, 1 + ε_high] (the test asserts both clip bounds
are hit). Each loss type, with and without the KL term (reference: the weights before the step).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from _fp64_twins import fp64_twins

from ftlib.models import LlamaForCausalLM
from ftlib.rl import GRPOConfig, RolloutBatch, group_advantages, grpo_loss, pack_rollouts, policy_logprobs

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head, entropy_from_logits, nanstd, selective_log_softmax  # noqa: E402

TEMPERATURE = 0.7
MAX_COMPLETION = 7
G = 3
PROMPTS = [[5, 9, 11, 3], [7, 2], [12, 30, 4, 8, 21]]
COMPLETIONS = [[3, 8, 1], [14, 2, 2, 9, 33, 1, 5], [6], [40, 41], [9, 9, 9, 9], [2, 17, 25, 1, 1],
               [22, 23, 24, 1], [31], [2, 3, 5, 7, 11, 13, 1]]
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 2.0, -1.0, 0.25]
PAD = 0


class _Acc:  # what _compute_loss needs of an Accelerator, on one process
    num_processes = 1
    is_main_process = True

    def autocast(self):
        return nullcontext()

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def gather_for_metrics(self, x):
        return x


def _fp64_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                              compute_entropy=False, compute_aux_loss=False, **_):
    # positions from 0 at each row's first real token (as ftlib's rows): both models take the RoPE angles in
    # fp32, so a left-padding shift of the absolute positions would move log-probs by ~1e-7
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits
    logits = logits[:, :-1][:, -logits_to_keep:]
    logits = logits / TEMPERATURE
    logps = selective_log_softmax(logits, input_ids[:, -logits_to_keep:])
    return logps, (entropy_from_logits(logits) if compute_entropy else None), None


def _trl_trainer(model, cfg: GRPOConfig, fp64: bool = True):
    t = GRPOTrainer.__new__(GRPOTrainer)
    if fp64:
        t._get_per_token_logps_and_entropies = _fp64_logps_and_entropies
    t.__dict__.update(
        loss_type=cfg.loss_type, importance_sampling_level="token", beta=cfg.beta, epsilon_low=cfg.epsilon_low,
        epsilon_high=cfg.epsilon_high, top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, model=model, current_gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION, accelerator=_Acc(), _metrics=defaultdict(lambda: defaultdict(list)),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, temperature=TEMPERATURE,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
    )
    return t


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # logits of a trained-like range: ratios move after the step
    _, ours, hf = fp64_twins(tmp_path_factory.mktemp("grpo_trl") / "base", head_scale=20.0)
    ours = ours.double()
    add_fused_lm_head(hf, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))  # the trainer's own head
    return ours, hf


def _trl_inputs():
    s = len(COMPLETIONS)
    p_rep = [PROMPTS[i // G] for i in range(s)]
    tp = max(map(len, p_rep))
    prompt_ids = torch.full((s, tp), PAD)
    prompt_mask = torch.zeros(s, tp, dtype=torch.long)
    for i, p in enumerate(p_rep):
        prompt_ids[i, tp - len(p):] = torch.tensor(p)
        prompt_mask[i, tp - len(p):] = 1
    comp_ids = torch.full((s, MAX_COMPLETION), PAD)
    comp_mask = torch.zeros(s, MAX_COMPLETION, dtype=torch.long)
    for i, c in enumerate(COMPLETIONS):
        comp_ids[i, : len(c)] = torch.tensor(c)
        comp_mask[i, : len(c)] = 1
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp_ids,
            "completion_mask": comp_mask}


def _rollouts():
    s = len(COMPLETIONS)
    return RolloutBatch(["p"] * s, [PROMPTS[i // G] for i in range(s)], COMPLETIONS, ["c"] * s,
                        [False] * s, G)


def _trl_advantages(rewards: torch.Tensor) -> torch.Tensor:
    # grpo_trainer._generate_and_score_completions, scale_rewards="group", one reward function
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
    return torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)


def test_group_advantages_match_trl():
    r = torch.tensor(REWARDS, dtype=torch.float64)
    torch.testing.assert_close(group_advantages(r, G).advantages, _trl_advantages(r), rtol=0, atol=1e-12)
    r_nan = r.clone()
    r_nan[4] = float("nan")  # unscorable: left out of its group's mean and std, advantage 0
    torch.testing.assert_close(group_advantages(r_nan, G).advantages, _trl_advantages(r_nan), rtol=0, atol=1e-12)
    dr = group_advantages(r, G, scale_rewards="none").advantages
    torch.testing.assert_close(dr, r - r.view(-1, G).mean(1).repeat_interleave(G), rtol=0, atol=1e-12)
    same = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), 3, drop_zero_std=True)
    assert same.keep.tolist() == [False] * 3 + [True] * 3 and same.stats["groups_dropped"] == 1
    assert same.stats["frac_reward_zero_std"] == 0.5


def _ours_tokens_to_rows(batch, logp: torch.Tensor) -> torch.Tensor:
    """Our flat per-token values [N] laid out as TRL's [S, MAX_COMPLETION] (0 elsewhere)."""
    out = torch.zeros(len(COMPLETIONS), MAX_COMPLETION, dtype=logp.dtype)
    sample = batch["sample_index"][batch["token_seq"]]
    for i in range(len(COMPLETIONS)):
        v = logp[sample == i]
        out[i, : v.numel()] = v
    return out


def _step(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05 * p.detach().abs().mean())


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no_kl", "kl"])
@pytest.mark.parametrize("mu", [1, 2])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_loss_and_gradient_equal_trl(models, loss_type, mu, beta):
    ours0, hf0 = models
    ours = LlamaForCausalLM(ours0.config).double()
    ours.load_state_dict(ours0.state_dict())
    hf = hf0  # restored at the end
    saved = {k: v.clone() for k, v in hf.state_dict().items()}
    cfg = GRPOConfig(loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=0.28,
                     max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE)
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    adv = group_advantages(rewards, G).advantages
    (batch,) = pack_rollouts(_rollouts(), pad_id=PAD)
    assert batch["input_ids"].shape[1] == sum(len(PROMPTS[i // G]) + len(c) for i, c in enumerate(COMPLETIONS))
    inputs = _trl_inputs()
    inputs["advantages"] = adv
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    trainer = _trl_trainer(hf, cfg)
    fused = _trl_trainer(hf, cfg, fp64=False)
    try:
        with torch.no_grad():  # the reference: the weights before any step
            ref = policy_logprobs(ours, batch, temperature=TEMPERATURE).logp
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            ref_trl, _, _ = trainer._get_per_token_logps_and_entropies(hf, ids, am, MAX_COMPLETION)
            ref_fused, _, _ = fused._get_per_token_logps_and_entropies(hf, ids, am, MAX_COMPLETION)
        cm = inputs["completion_mask"]
        torch.testing.assert_close(_ours_tokens_to_rows(batch, ref) * cm, ref_trl * cm, rtol=0, atol=1e-10)
        torch.testing.assert_close(_ours_tokens_to_rows(batch, ref).float() * cm, ref_fused * cm, rtol=0, atol=1e-4)
        if beta:
            inputs["ref_per_token_logps"] = ref_trl
        old = None
        if mu == 2:  # π_old from the first pass, then one update of both models
            old = ref
            inputs["old_per_token_logps"] = ref_trl
            _step(ours, 1)
            _step(hf, 1)
        hf.eval()  # no dropout either way; in train mode transformers' attention moves gradients by ~1e-7
        trl_loss = trainer._compute_loss(hf, inputs)
        trl_loss.backward()
        lp = policy_logprobs(ours, batch, temperature=TEMPERATURE, entropy=True)
        out = grpo_loss(lp.logp, adv[batch["sample_index"]], batch["token_seq"], cfg, old_logps=old, ref_logps=ref if beta else None,
                        entropy=lp.entropy)
        out.loss.backward()
        assert abs(float(out.loss) - float(trl_loss)) <= 1e-6 * max(1.0, abs(float(trl_loss))), (
            float(out.loss), float(trl_loss))
        assert abs(float(out.loss) - float(trl_loss)) <= 1e-9  # in fact much closer than the 1e-6
        hf_grads, worst = dict(hf.named_parameters()), [0.0]
        for name, p in ours.named_parameters():
            want = hf_grads[name].grad
            # relative to the tensor's largest entry: the bar is 1e-6, fp64 gives ~1e-15
            err = float((p.grad - want).abs().max()) / max(float(want.abs().max()), 1e-12)
            assert err <= 1e-10, (name, err)
            worst[0] = max(worst[0], err)
        m = trainer._metrics["eval"]
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy") + (
                ("kl",) if beta else ()):
            assert abs(out.stats[key] - m[key][-1]) <= 1e-6, (key, out.stats[key], m[key][-1])
        print(f"{loss_type} mu={mu} beta={beta}: |loss diff| {abs(float(out.loss) - float(trl_loss)):.2e}, "
              f"max relative gradient diff {worst[0]:.2e}")
        if mu == 2:  # the clip bounds are really exercised
            assert out.stats["clip_ratio/low_mean"] > 0 and out.stats["clip_ratio/high_mean"] > 0, out.stats
    finally:
        hf.zero_grad(set_to_none=True)
        hf.load_state_dict(saved)
