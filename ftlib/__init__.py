"""ftlib: a small, composable, pure-PyTorch library for fine-tuning LLMs from your own loop.

Modules (import the ones you need; nothing here pulls in optional dependencies):

- ``ftlib.models``   Llama-family decoder, Hugging Face checkpoint I/O, KV-cache generation
- ``ftlib.data``     sources, chat formatting with loss masks, Arrow token cache, packing, loader
- ``ftlib.lora``     LoRA / rsLoRA / DoRA / QLoRA (NF4) layers, merge, PEFT-format adapters
- ``ftlib.optim``    optimizer wrapper: precision, loss scaling, token-weighted accumulation
- ``ftlib.clip``     gradient clippers (global norm, z-score EMA, AGC, per-layer)
- ``ftlib.sched``    LR schedules (warmup + cosine/linear/constant, WSD, plateau-aware hybrid)
- ``ftlib.preference``  DPO-family losses, chunked sequence log-probs, reference log-probs (pairs: ``ftlib.data.pairs``)
- ``ftlib.kernels``  attention dispatch (flash-attn / Triton / PyTorch reference)
- ``ftlib.checkpoint``  atomic, verified train-state checkpoints; exact resume
- ``ftlib.metrics``  progress bar, per-step JSONL, MFU, peak memory, plots
- ``ftlib.evaluation``  held-out loss / perplexity, exact match through generation

- ``ftlib.offload``  activation offloading to pinned host memory (per block, with checkpointing)
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
