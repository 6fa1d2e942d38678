"""Tiny, self-made assets for ``finetune_lora.py --demo``: no download, a few seconds on a CPU.

Writes under ``root``:

- ``base/``: a Hugging Face-layout checkpoint of a 2-layer Llama (config.json +
  model.safetensors) with a byte-level BPE ``tokenizer.json`` trained on the demo text and a
  ``tokenizer_config.json`` holding the ChatML template and the special tokens;
- ``data/train.jsonl``: chat records ``{"messages": [...]}`` of small arithmetic questions,
  the kind of task a tiny model learns visibly in a hundred steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

__all__ = ["make_demo_assets", "demo_records", "demo_pairs"]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
          "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]


def demo_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` chat records: "What is a plus b?" -> "a plus b is c." (words and digits mixed)."""
    rng = random.Random(seed)
    recs = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        q = f"What is {a} plus {b}?" if rng.random() < 0.5 else f"What is {_WORDS[a]} plus {_WORDS[b]}?"
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        if rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": "You are a careful calculator."})
        recs.append({"messages": msgs})
    return recs


def demo_pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` preference records ``{"messages": [user], "chosen": str, "rejected": str}``.

    The chosen answer states the right sum, the rejected one a wrong sum (off by 1 to 3, never
    negative) in the same words, so a preference is checkable and differs in the number only.
    """
    rng = random.Random(seed)
    recs = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        q = f"What is {a} plus {b}?" if rng.random() < 0.5 else f"What is {_WORDS[a]} plus {_WORDS[b]}?"
        wrong = a + b + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if a + b + d >= 0])
        recs.append({"messages": [{"role": "user", "content": q}],
                     "chosen": f"{a} plus {b} is {a + b}.", "rejected": f"{a} plus {b} is {wrong}."})
    return recs


def _train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def make_demo_assets(root: str | Path, n_records: int = 2000, seed: int = 0) -> Path:
    """Write the demo model, tokenizer and data under ``root`` (idempotent); returns ``root``."""
    from ftlib.data import render_chat
    from ftlib.models import LlamaConfig, LlamaForCausalLM, save_pretrained

    root = Path(root)
    base, data = root / "base", root / "data"
    if (base / "config.json").exists() and (data / "train.jsonl").exists():
        return root
    recs = demo_records(n_records, seed)
    tok = _train_tokenizer([render_chat(r["messages"], CHATML) for r in recs])

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=352,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"))
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # A pretrained LM head has logits of a useful range; the default 0.02-std init caps them near
        # +-2.5 here, which no adapter on the (frozen) head could overcome. Give it a trained-like scale.
        model.lm_head.weight.normal_(0.0, 2.0 / cfg.hidden_size**0.5)
    save_pretrained(model, base)
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<unk>",
        "bos_token": None, "model_max_length": 1024,
    }, indent=1))

    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.jsonl", "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return root
