"""Llama-family models with Hugging Face checkpoint I/O and KV-cache generation.

- ``LlamaConfig`` / ``LlamaForCausalLM``: the decoder (Llama 2/3/3.1/3.2, Qwen2/2.5, Mistral);
- ``load_pretrained`` / ``save_pretrained``: config.json + sharded safetensors, loaded tensor by tensor;
- ``load_tokenizer``: tokenizer.json + special tokens + sandboxed chat template; ``check_vocab``: its ids fit
  the model's embedding;
- ``generate`` / ``KVCache``: decoding with a cache that lives outside the model;
- ``LlamaRewardModel`` / ``score`` / ``save_reward_model`` / ``load_reward_model``: a scalar reward head
  in ``transformers``' sequence-classification layout.
"""

from .config import LlamaConfig
from .generate import KVCache, generate, sample_next
from .hub import load_config, load_pretrained, parse_size, save_pretrained
from .llama import LlamaForCausalLM, LlamaModel, RMSNorm
from .reward import (
    LlamaRewardModel,
    load_reward_model,
    pack_documents,
    pairwise_accuracy,
    save_reward_model,
    score,
)
from .rope import apply_rope, rope_cos_sin, rope_inv_freq
from .tokenizer import PretrainedTokenizer, load_tokenizer, render_chat_template
from .vocab import check_vocab

__all__ = [
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "RMSNorm",
    "LlamaRewardModel",
    "load_reward_model",
    "pack_documents",
    "pairwise_accuracy",
    "save_reward_model",
    "score",
    "KVCache",
    "generate",
    "sample_next",
    "load_config",
    "load_pretrained",
    "save_pretrained",
    "parse_size",
    "load_tokenizer",
    "check_vocab",
    "PretrainedTokenizer",
    "render_chat_template",
    "apply_rope",
    "rope_cos_sin",
    "rope_inv_freq",
]
