"""Tiny, self-made demo assets (the demo of `ftlib sft --demo` and of the examples): no download, a few seconds on a CPU.

The task: reverse a list of 3 to 5 words ("Reverse the words: lamp river stone" -> "stone river
lamp"). It is a rule, not a table of facts, so it can be checked on word lists the model never
saw: ``heldout_records()`` are 64 fixed lists that no training record, preference pair or the
tokenizer's training text contains. (Single-digit sums, the demo's first task, are 100 facts:
a tiny model memorises the ones it is shown and cannot answer held-out ones.)

Writes under ``root``:

- ``base/``: a Hugging Face-layout checkpoint of a 2-layer Llama (config.json +
  model.safetensors, random weights: the base model cannot do the task) with a byte-level BPE
  ``tokenizer.json`` trained on the training text and a ``tokenizer_config.json`` holding the
  ChatML template and the special tokens;
- ``data/train.jsonl``: chat records ``{"messages": [...]}`` (``demo_records``);
- ``eval/heldout.jsonl``: the held-out records, same layout.

``DEMO_LEXICON`` is the folder of a synonym and POS lexicon of the demo's words (for ``--augment``),
shipped with the package.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

__all__ = ["CHATML", "DEMO_LEXICON", "PROMPT", "WORDS", "arithmetic_pairs", "demo_records", "dpo_demo_pairs",
           "dpo_demo_setup", "heldout_pairs", "heldout_records", "make_demo_assets", "noisy_sft", "pair_score",
           "prompt_records", "reward_demo_pairs"]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
WORDS = ("apple bird cloud door egg fish goat hat ink jam kite lamp moon nest owl pear queen rock sun tree "
         "van wolf box yarn zoo cat dog leaf milk road ship star wind gold salt rain snow fire coin bell").split()
PROMPT = "Reverse the words: "
N_HELDOUT = 64
# synonyms.tsv + pos.tsv for the demo's words (``ftlib sft --demo --augment``; ftlib.augment.load_lexicon_dir)
DEMO_LEXICON = Path(__file__).resolve().parent / "demo_lexicon"
_HELDOUT_SEED = 20240601  # fixed: the held-out lists do not depend on the training seed


def _word_list(rng: random.Random) -> tuple[str, ...]:
    return tuple(rng.sample(WORDS, rng.randint(3, 5)))


def _heldout_lists() -> list[tuple[str, ...]]:
    rng, out = random.Random(_HELDOUT_SEED), []
    while len(out) < N_HELDOUT:
        w = _word_list(rng)
        if w not in out:
            out.append(w)
    return out


_HELDOUT = _heldout_lists()
_HELDOUT_SET = set(_HELDOUT)


def _training_lists(n: int, seed: int) -> list[tuple[str, ...]]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        w = _word_list(rng)
        if w not in _HELDOUT_SET:  # held out: never trained on
            out.append(w)
    return out


def _chat(words: tuple[str, ...], system: bool = False) -> list[dict]:
    msgs = [{"role": "user", "content": PROMPT + " ".join(words)},
            {"role": "assistant", "content": " ".join(reversed(words))}]
    if system:
        msgs.insert(0, {"role": "system", "content": "You are a careful assistant."})
    return msgs


def demo_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` training chat records (30 % with a system prompt); none is a held-out list."""
    rng = random.Random(seed + 1)
    return [{"messages": _chat(w, system=rng.random() < 0.3)} for w in _training_lists(n, seed)]


def heldout_records() -> list[dict]:
    """The ``N_HELDOUT`` held-out chat records (user question + the right answer)."""
    return [{"messages": _chat(w)} for w in _HELDOUT]


def _wrong_order(words: tuple[str, ...], rng: random.Random) -> list[str]:
    """The same words in a wrong order: the list as given, or reversed with two neighbours swapped."""
    right = list(reversed(words))
    if rng.random() < 0.5:
        return list(words)
    wrong = list(right)
    i = rng.randrange(len(wrong) - 1)
    wrong[i], wrong[i + 1] = wrong[i + 1], wrong[i]
    return wrong


def _pairs(lists, rng: random.Random) -> list[dict]:
    return [{"messages": [{"role": "user", "content": PROMPT + " ".join(w)}],
             "chosen": " ".join(reversed(w)), "rejected": " ".join(_wrong_order(w, rng))} for w in lists]


def heldout_pairs(seed: int = 0) -> list[dict]:
    """One preference record per held-out list (``heldout_records``): prompts no training record has.

    The chosen answer is the reversed list; the rejected one holds the same words in a wrong order (the
    list as given, or reversed with two neighbours swapped): checkable, differing in the order only."""
    return _pairs(_HELDOUT, random.Random(seed + 3))


def pair_score(prompt: str, answer: str) -> float:
    """A checkable reward: minus the number of positions where ``answer`` differs from the reversed list."""
    want = list(reversed(prompt[len(PROMPT):].split())) if prompt.startswith(PROMPT) else []
    got = answer.split()
    return -float(sum(a != b for a, b in zip(want, got)) + abs(len(want) - len(got)))


_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def arithmetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` preference records on single-digit sums ("What is 3 plus four?"): the chosen answer states
    the right sum, the rejected one a wrong sum (off by 1 to 3, never negative) in the same words.

    The reward-model demo's pairs: 200 distinct questions, so held-out comparisons can pair a seen
    question with an unseen wrong answer (``reward_demo_pairs``)."""
    rng = random.Random(seed)
    recs = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        q = f"What is {a} plus {b}?" if rng.random() < 0.5 else f"What is {_NUMBER_WORDS[a]} plus {_NUMBER_WORDS[b]}?"
        wrong = a + b + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if a + b + d >= 0])
        recs.append({"messages": [{"role": "user", "content": q}],
                     "chosen": f"{a} plus {b} is {a + b}.", "rejected": f"{a} plus {b} is {wrong}."})
    return recs


def reward_demo_pairs(root: str | Path, n_prompts: int = 24, seed: int = 0) -> tuple[Path, Path]:
    """The reward-model demo's pairs files under ``root`` (``train.jsonl``, ``eval.jsonl``; idempotent):
    the distinct ``arithmetic_pairs`` of ``n_prompts`` questions, split by the rejected answer, so
    training and held-out comparisons share questions and the right answer, never a (question,
    wrong answer) pair. Returns (train path, eval path)."""
    import zlib

    root = Path(root)
    paths = root / "train.jsonl", root / "eval.jsonl"
    if all(p.exists() for p in paths):
        return paths
    distinct = {json.dumps(r, sort_keys=True): r for r in arithmetic_pairs(4000, seed=1)}
    prompts = sorted({json.dumps(r["messages"]) for r in distinct.values()})
    random.Random(seed).shuffle(prompts)
    keep = set(prompts[:n_prompts])
    recs = [r for _, r in sorted(distinct.items()) if json.dumps(r["messages"]) in keep]
    held = [zlib.crc32((json.dumps(r["messages"]) + r["rejected"]).encode()) % 2 == 1 for r in recs]
    root.mkdir(parents=True, exist_ok=True)
    for path, want in zip(paths, (False, True)):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r, h in zip(recs, held) if h == want))
        tmp.replace(path)
    return paths


def dpo_demo_setup(out: str | Path, *, seed: int = 0, sft_steps: int = 125, threads: int = 1,
                   sft: bool = True) -> dict:
    """The DPO demo's files under ``out`` (idempotent): the demo assets (``out/demo``), the held-out pairs
    and, with ``sft``, a short ``ftlib sft`` run (``out/sft``, its own process) whose adapter merged
    into the base is the starting (and reference) model. Returns ``{"model", "sft_adapter", "train",
    "eval"}``: the base folder, the SFT adapter (None without ``sft``), the training pairs' path (written
    by ``dpo_demo_pairs``) and the held-out pairs file.

    Held out: one pair for each of the 64 held-out word lists, prompts no SFT training record contains
    (``heldout_pairs``), each with a checkable score (``reward_chosen`` 0, ``reward_rejected`` minus the
    number of misplaced words). The SFT run (r 64, alpha 256, ``sft_steps`` steps) learns the answer
    format and part of the task (held-out exact match about 0.5 at 125 steps; near 1 at 150+, when
    DPO has little left to fix)."""
    import os
    import subprocess
    import sys

    from ftlib.onpolicy import write_pairs

    out = Path(out)
    make_demo_assets(out / "demo")
    base, pairs_dir = out / "demo" / "base", out / "demo" / "pairs"
    if not (pairs_dir / "eval.jsonl").exists():
        recs = heldout_pairs(seed=seed)
        for r in recs:
            prompt = r["messages"][-1]["content"]
            r["reward_chosen"], r["reward_rejected"] = pair_score(prompt, r["chosen"]), pair_score(prompt, r["rejected"])
        write_pairs(recs, pairs_dir / "eval.jsonl")
    adapter = out / "sft" / "adapter"
    if sft and not (adapter / "adapter_config.json").exists():
        print(f"== SFT first: {sft_steps} steps of ftlib sft on the demo chat data", flush=True)
        # its own process (one process: no torchrun variables), this ftlib first on the path
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                             *filter(None, [env.get("PYTHONPATH")])])
        subprocess.run([sys.executable, "-m", "ftlib", "sft", "--model", str(base), "--data", str(out / "demo" / "data"),
                        "--out", str(out / "sft"), "--seq-len", "256", "--batch-size", "4", "--grad-accum", "1",
                        "--lr", "2e-3", "--lora-r", "64", "--lora-alpha", "256", "--epochs", "3",
                        "--max-steps", str(sft_steps), "--log-every", "25", "--num-proc", "1", "--num-workers", "0",
                        "--seed", str(seed), "--threads", str(threads)], check=True, env=env)
    return {"model": str(base), "sft_adapter": str(adapter) if sft else None,
            "train": str(pairs_dir / "train.jsonl"), "eval": str(pairs_dir / "eval.jsonl")}


def dpo_demo_pairs(model, tokenizer, chat_template: str, out: str | Path, path: str | Path, *, prompts: int = 600,
                   samples: int = 4, seed: int = 0, stop_tokens=None, log=print) -> None:
    """The DPO demo's training pairs, on-policy, written to ``path`` unless it exists: ``model`` (the SFT
    model) answers ``prompts`` of its own training prompts (``out/demo/data``; greedy + ``samples``
    samples), ``pair_score`` scores the answers, and each prompt's best answer (or the right one, when
    the model never found it) is preferred to its mistakes (``ftlib.onpolicy``; no held-out prompt)."""
    from ftlib.onpolicy import OnPolicyConfig, build_onpolicy_pairs, split_last_answer, write_pairs

    path = Path(path)
    if path.exists():
        return
    recs = [json.loads(line) for line in (Path(out) / "demo" / "data" / "train.jsonl").read_text().splitlines()]
    asked, answers = zip(*(split_last_answer(r["messages"]) for r in recs[:prompts]))
    checker = lambda ps, ans: [pair_score(p[-1]["content"], a) for p, a in zip(ps, ans)]
    built = build_onpolicy_pairs(model, tokenizer, list(asked), checker, chat_template=chat_template,
                                 references=list(answers), exclude=[r["messages"][:-1] for r in heldout_records()],
                                 stop_tokens=stop_tokens, config=OnPolicyConfig(samples=samples, temperature=1.0,
                                                                                max_new_tokens=24, seed=seed))
    write_pairs(built.records, path)
    st = built.stats
    log(f"on-policy pairs: {st.pairs} from {st.prompts} training prompts (greedy answer already best on "
        f"{st.greedy_best}; {st.reference_chosen} pairs prefer the reference answer; {st.no_pair} prompts "
        f"without a mistake; {st.empty_answers} empty and {st.repeated_answers} repeated answers dropped)")


def prompt_records(records: list[dict]) -> list[dict]:
    """The GRPO demo's prompts: ``{"prompt": "Reverse the words: ...", "answer": the reversed list}`` of
    demo chat records (``demo_records`` for training, ``heldout_records`` held out)."""
    out = []
    for r in records:
        prompt = r["messages"][-2]["content"]
        out.append({"prompt": prompt, "answer": " ".join(reversed(prompt[len(PROMPT):].split()))})
    return out


def noisy_sft(model, tokenizer, prompts: list[dict], *, steps: int, seed: int = 0, right: float = 0.5,
              lr: float = 3e-3, batch_size: int = 32) -> None:
    """The GRPO demo's starting point: SFT on ``prompt_records`` in which a fraction ``right`` of the answers
    is the reversed list and the others the list as given (a systematic error, as from a weak teacher),
    so the model learns both behaviours: partial skill by construction. AdamW on every parameter,
    ``steps`` batches of ``batch_size`` chat-formatted (``CHATML``) prompts, loss on the answer + EOS."""
    import numpy as np

    from ftlib.data import pad_collate, render_chat
    from ftlib.losses import causal_lm_loss

    rng, eos = random.Random(seed), tokenizer.eos_token_id
    pad = tokenizer.pad_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        docs = []
        for r in rng.sample(prompts, min(batch_size, len(prompts))):
            words = r["prompt"][len(PROMPT):].split()
            answer = " ".join(reversed(words)) if rng.random() < right else " ".join(words)
            text = render_chat([{"role": "user", "content": r["prompt"]}], CHATML, add_generation_prompt=True)
            p = tokenizer.encode(text, add_special_tokens=False)
            a = tokenizer.encode(answer, add_special_tokens=False) + [eos]
            docs.append((np.array(p + a), np.array([0] * len(p) + [1] * len(a))))
        loss, n = causal_lm_loss(model, pad_collate(docs, pad))
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def _random_base(tok):
    """The 2-layer base model, randomly initialised (it cannot do the task before training)."""
    from ftlib.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=352,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"))
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # A pretrained LM head has logits of a useful range; the default 0.02-std init caps them near
        # +-2.5 here, which no adapter on the (frozen) head could overcome. Give it a trained-like scale.
        model.lm_head.weight.normal_(0.0, 2.0 / cfg.hidden_size**0.5)
    return model


def make_demo_assets(root: str | Path, n_records: int = 2000, seed: int = 0) -> Path:
    """Write the demo model, tokenizer and data under ``root`` (idempotent); returns ``root``."""
    from ftlib.data import render_chat
    from ftlib.models import save_pretrained

    root = Path(root)
    base, data, held = root / "base", root / "data", root / "eval"
    if (base / "config.json").exists() and (data / "train.jsonl").exists() and (held / "heldout.jsonl").exists():
        return root
    recs = demo_records(n_records, seed)
    tok = _train_tokenizer([render_chat(r["messages"], CHATML) for r in recs])

    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(seed)
        model = _random_base(tok)
    save_pretrained(model, base)
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<unk>",
        "bos_token": None, "model_max_length": 1024,
    }, indent=1))

    for folder, name, rows in ((data, "train.jsonl", recs), (held, "heldout.jsonl", heldout_records())):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(folder / name)  # whole or absent: the check at the top trusts these files
    return root
