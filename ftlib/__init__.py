"""ftlib: a small, composable, pure-PyTorch library for fine-tuning LLMs from your own loop.

Modules (import the ones you need; nothing here pulls in optional dependencies):

- ``ftlib.models``   Llama-family decoder, Hugging Face checkpoint I/O, KV-cache generation
- ``ftlib.data``     sources, chat formatting with loss masks, Arrow token cache, packing, loader
- ``ftlib.lora``     LoRA / rsLoRA / DoRA / QLoRA (NF4) layers, merge, PEFT-format adapters
- ``ftlib.optim``    optimizer wrapper: precision, loss scaling, token-weighted accumulation
- ``ftlib.clip``     gradient clippers (global norm, z-score EMA, AGC, per-layer)
- ``ftlib.sched``    LR schedules (warmup + cosine/linear/constant, WSD, plateau-aware hybrid)
- ``ftlib.kernels``  attention dispatch (flash-attn / Triton / PyTorch reference)
- ``ftlib.distributed``  FSDP2 / HSDP / DDP sharding, sharded checkpoints, full-state exports, memory calculator
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
