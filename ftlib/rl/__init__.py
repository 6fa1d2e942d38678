"""Online RL with verifiable rewards (GRPO and its Dr. GRPO / DAPO variants) and KTO, for a loop you own.

Plain functions and small objects, no trainer: ``rollout`` samples G completions per prompt through a
``Generator`` (``ModelGenerator``: ``ftlib.models.generate``, dropout off), ``compute_rewards`` scores
them with user callables and built-ins, ``group_advantages`` turns rewards into advantages,
``pack_rollouts`` lays prompt + completion out in packed rows, ``policy_logprobs`` /
``reference_logprobs`` give per-token log-probs from the chunked head, and ``grpo_loss`` is TRL's
GRPO loss (grpo / bnpo / dr_grpo / dapo aggregation). ``kto_loss`` is TRL's KTO loss.
See ``examples/grpo.py`` for the loop and ``ftlib grpo`` (``ftlib.cli.grpo``) for the command.
"""

from .grpo import (
    LOSS_TYPES,
    Advantages,
    GRPOConfig,
    GRPOLossOutput,
    group_advantages,
    grpo_loss,
    policy_logprobs,
    reference_logprobs,
)
from .kto import KTOConfig, KTOOutput, check_kto_records, kto_logps, kto_loss, pack_kto, reference_kto_logps
from .rewards import (
    RewardError,
    RewardResult,
    boxed_answer,
    compute_rewards,
    exact_answer_reward,
    format_reward,
    greedy_reward,
    last_number,
    reward_model_reward,
)
from .rollout import Generator, ModelGenerator, RolloutBatch, SamplingConfig, pack_rollouts, rollout

__all__ = [
    "Advantages", "GRPOConfig", "GRPOLossOutput", "Generator", "KTOConfig", "KTOOutput", "LOSS_TYPES",
    "ModelGenerator", "RewardError", "RewardResult", "RolloutBatch", "SamplingConfig", "boxed_answer",
    "check_kto_records", "compute_rewards", "exact_answer_reward", "format_reward", "greedy_reward", "group_advantages", "grpo_loss",
    "kto_logps", "kto_loss", "last_number", "pack_kto", "pack_rollouts", "policy_logprobs", "reference_kto_logps",
    "reference_logprobs", "reward_model_reward", "rollout",
]
