"""A user's own small setup for the end-to-end command-line tests: a tiny Llama in a model folder whose
tokenizer_config.json holds its chat template as text, and chat JSONL with a few malformed lines.

Everything is built here (no download) and kept small: one decoder layer of width 32, a 300-entry
BPE vocabulary, 48 training records; a script run on it takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SFT = ("-m", "ftlib", "sft")  # the command as installed: python -m ftlib sft

# A template written as text (not a built-in name), ChatML-like with its own markers.
TEMPLATE = ("{% for m in messages %}<|turn|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|turn|>assistant\n{% endif %}")
SPECIALS = ["<unk>", "<|turn|>", "<|end|>", "<pad>"]
WORDS = "red green blue cat dog sun moon tree rock fish bird star lake road".split()
N_BAD = 3  # malformed lines in train.jsonl


def chat(i: int) -> dict:
    a, b = WORDS[i % len(WORDS)], WORDS[(3 * i + 1) % len(WORDS)]
    return {"messages": [{"role": "user", "content": f"say {a} {b}"}, {"role": "assistant", "content": f"{b} {a}"}]}


def _tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def make_model_folder(folder: Path, tok, *, template: str | None) -> Path:
    from ftlib.models import LlamaConfig, LlamaForCausalLM, save_pretrained

    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.token_to_id("<|end|>"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        save_pretrained(LlamaForCausalLM(cfg), folder)
    tok.save(str(folder / "tokenizer.json"))
    tc = {"eos_token": "<|end|>", "pad_token": "<pad>", "unk_token": "<unk>", "bos_token": None}
    if template is not None:
        tc["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    return folder


def make_user_setup(root: Path) -> dict:
    """Paths: model (with template), bare (the same model, no template), train.jsonl (48 good records
    and N_BAD malformed lines), eval.jsonl (8 records, 2 of them also in train), sharegpt.jsonl."""
    from ftlib.data import render_chat

    recs = [chat(i) for i in range(48)]
    tok = _tokenizer([render_chat(r["messages"], TEMPLATE) for r in recs])
    model = make_model_folder(root / "model", tok, template=TEMPLATE)
    bare = make_model_folder(root / "bare", tok, template=None)
    lines = [json.dumps(r) for r in recs]
    lines.insert(5, '{"messages": [{"role": "user", "content": "cut')          # not JSON
    lines.insert(20, json.dumps({"text": "no messages field"}))                   # missing field
    lines.insert(30, json.dumps({"messages": [{"role": "user"}]}))               # no content
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    held = [{"messages": [{"role": "user", "content": f"say {WORDS[i]} {WORDS[i + 1]} {WORDS[i + 2]}"},
                          {"role": "assistant", "content": f"{WORDS[i + 2]} {WORDS[i + 1]} {WORDS[i]}"}]}
            for i in range(6)] + recs[:2]  # the last two are training records
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    share = [{"conversations": [{"from": "system", "value": "be brief"},
                                {"from": "human", "value": m["messages"][0]["content"]},
                                {"from": "gpt", "value": m["messages"][1]["content"]}]} for m in recs[:24]]
    (root / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in share))
    return {"root": root, "model": model, "bare": bare, "train": root / "train.jsonl", "eval": root / "eval.jsonl",
            "sharegpt": root / "sharegpt.jsonl"}


SMALL = ["--seq-len", "64", "--batch-size", "2", "--grad-accum", "1", "--lora-r", "2", "--num-proc", "1",
         "--num-workers", "0", "--log-every", "1", "--lr", "1e-2", "--threads", "1"]


def run_cli(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    """``args`` run as a user would: a subprocess, this tree's ftlib first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def train(*args, **kw) -> subprocess.CompletedProcess:
    return run_cli(*SFT, *SMALL, *args, **kw)
