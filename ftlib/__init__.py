"""ftlib: a small, composable, pure-PyTorch library for fine-tuning LLMs from your own loop.

Modules (import the ones you need; nothing here pulls in optional dependencies):

- ``ftlib.models``   Llama-family decoder, Hugging Face checkpoint I/O, KV-cache generation, reward models
- ``ftlib.data``     sources, chat formatting with loss masks, Arrow token cache, packing, loader, preference pairs
- ``ftlib.lora``     LoRA / rsLoRA / DoRA / QLoRA (NF4) layers, merge, PEFT-format adapters, rank decay
- ``ftlib.optim``    optimizer wrapper: precision (with an fp16 -> fp32 fallback), loss scaling, token-weighted accumulation
- ``ftlib.clip``     gradient clippers (global norm, z-score EMA, AGC, per-layer)
- ``ftlib.sched``    LR schedules (warmup + cosine/linear/constant, WSD, plateau-aware hybrid, warm restarts)
- ``ftlib.losses``   token-summed and chunked cross-entropy, Bradley-Terry reward loss
- ``ftlib.preference``  DPO-family losses, chunked sequence log-probs, reference log-probs (pairs: ``ftlib.data.pairs``)
- ``ftlib.rl``       online RL with verifiable rewards: rollouts, rewards, GRPO / Dr. GRPO / DAPO losses, KTO
- ``ftlib.kernels``  attention (flash-attn / Triton / SDPA / reference), fused LoRA matmul, token augmentation
- ``ftlib.augment``  synonym swap and POS-aware masking of target tokens on the device
- ``ftlib.embed_noise``  NEFTune noise on the input embeddings, per packed document
- ``ftlib.checkpoint``  atomic, verified train-state checkpoints; exact resume
- ``ftlib.metrics``  progress bar, per-step JSONL, MFU, peak memory, plots
- ``ftlib.evaluation``  held-out loss / perplexity, exact match through generation
- ``ftlib.offload``  activation offloading to pinned host memory (per block, with checkpointing)
- ``ftlib.distributed``  FSDP2 / HSDP / DDP sharding, sharded checkpoints, full-state exports, memory calculator
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
