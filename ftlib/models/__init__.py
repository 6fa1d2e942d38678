"""Llama-family models with Hugging Face checkpoint I/O and KV-cache generation.

- ``LlamaConfig`` / ``LlamaForCausalLM``: the decoder (Llama 2/3/3.1/3.2, Qwen2/2.5/3, Mistral, Gemma-2/3,
  Phi-3, OLMo-2, SmolLM3, and the MoE families Qwen3-MoE, Mixtral, Qwen2-MoE);
- ``RouterStats``: an MoE forward's router logits, load-balancing and z losses, per-expert counts;
- ``load_pretrained`` / ``save_pretrained``: config.json + sharded safetensors, loaded tensor by tensor;
- ``load_tokenizer``: tokenizer.json + special tokens + sandboxed chat template; ``check_vocab``: its ids fit
  the model's embedding;
- ``SafetensorsReader``: memory-mapped reads of one safetensors file, tensor by tensor;
- ``generate`` / ``KVCache``: decoding with a cache that lives outside the model;
- ``LlamaRewardModel`` / ``score`` / ``save_reward_model`` / ``load_reward_model``: a scalar reward head
  in ``transformers``' sequence-classification layout.
"""

from ._safetensors_io import SafetensorsReader
from .config import LlamaConfig
from .generate import KVCache, generate, sample_next
from .hub import load_config, load_pretrained, parse_size, save_pretrained
from .llama import LlamaForCausalLM, LlamaModel, RMSNorm
from .moe import RouterStats
from .reward import (
    LlamaRewardModel,
    load_reward_model,
    pair_rewards,
    pairwise_accuracy,
    save_reward_model,
    score,
)
from .rope import apply_rope, rope_cos_sin, rope_inv_freq
from .tokenizer import PretrainedTokenizer, load_tokenizer
from .vocab import check_vocab

__all__ = [
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "LlamaRewardModel",
    "PretrainedTokenizer",
    "RMSNorm",
    "RouterStats",
    "SafetensorsReader",
    "apply_rope",
    "check_vocab",
    "generate",
    "load_config",
    "load_pretrained",
    "load_reward_model",
    "load_tokenizer",
    "pair_rewards",
    "pairwise_accuracy",
    "parse_size",
    "rope_cos_sin",
    "rope_inv_freq",
    "sample_next",
    "save_pretrained",
    "save_reward_model",
    "score",
]
