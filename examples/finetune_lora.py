"""Fine-tune a Llama-family model with LoRA / rsLoRA / DoRA / QLoRA from a loop you own.

Read it top to bottom, copy it, change it. The recipe:

    1. load the base model and tokenizer (Hugging Face folder or hub repo id)
    2. adapt it (LoRA, optionally on an NF4-quantized base = QLoRA)
    3. tokenize the data once into a memory-mapped token cache, pack it into rows
    4. loop: forward (chunked loss, no full logits) -> backward -> clip -> step -> schedule
    5. save the adapter in PEFT's format (and, on request, a merged bf16 checkpoint)

A real run on one GPU (Llama-3-8B, QLoRA, chat data in JSONL with a "messages" field):

    python examples/finetune_lora.py --model meta-llama/Meta-Llama-3-8B-Instruct \\
        --data data/chat/ --format chat --qlora --precision bf16 --grad-ckpt \\
        --seq-len 4096 --batch-size 2 --grad-accum 8 --lr 2e-4 --out runs/llama3-qlora

On several GPUs, launch the same script with ``torchrun --nproc_per_node=N``: the loader shards
the data by rank, gradients are averaged by DDP and the loss is normalised by the target tokens
of the whole window on all ranks.

``--demo`` builds a tiny model, tokenizer and chat dataset on the fly (no download) and trains
on them, so the whole path runs on a laptop CPU in a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ftlib.clip import GlobalNormClipper
from ftlib.data import FormatConfig, TokenLoader, build_cache
from ftlib.lora import LoRAConfig, apply_lora, count_params, merge_and_unload, save_adapter
from ftlib.losses import chunked_cross_entropy
from ftlib.models import generate, load_pretrained, load_tokenizer, save_pretrained
from ftlib.optim import TrainOptimizer, make_adamw, param_groups
from ftlib.sched import LRScheduler, PlateauCosine, WarmupDecay, resolve_warmup

DEFAULTS = {"seq_len": 2048, "batch_size": 4, "grad_accum": 4, "epochs": 1, "lr": 2e-4}
DEMO_DEFAULTS = {"seq_len": 256, "batch_size": 4, "grad_accum": 2, "epochs": 3, "lr": 3e-3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF model folder or hub repo id")
    p.add_argument("--data", nargs="+", help="JSONL/Parquet/text files, folders or tar shards")
    p.add_argument("--format", choices=["chat", "instruction", "text"], default="chat")
    p.add_argument("--chat-template", help="Jinja text or a built-in name (chatml, llama3); default: the tokenizer's")
    p.add_argument("--out", required=True, help="output folder (cache, adapter, logs)")
    p.add_argument("--seq-len", type=int, default=None, help="packed row length (default 2048; demo 256)")
    p.add_argument("--batch-size", type=int, default=None, help="packed rows per micro-batch per rank (4; demo 4)")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-batches per optimizer step (4; demo 2)")
    p.add_argument("--epochs", type=int, default=None, help="passes over the data (1; demo 3)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (2e-4; demo 3e-3)")
    p.add_argument("--lora-plus", type=float, default=None, help="LoRA+ ratio: lr of B = ratio * lr")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--schedule", choices=["cosine", "linear", "constant", "plateau"], default="cosine")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm bound")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--targets", default="all-linear", help="'all-linear' or comma-separated module names")
    p.add_argument("--rslora", action="store_true")
    p.add_argument("--dora", action="store_true")
    p.add_argument("--qlora", action="store_true", help="NF4 base weights (double-quantized absmax)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None,
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing on every block")
    p.add_argument("--num-proc", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="tokenizer processes")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps between log lines")
    p.add_argument("--save-merged", action="store_true", help="also write a merged bf16 HF checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo", action="store_true", help="tiny model + data built on the fly")
    # On-device augmentation of each batch (see setup_augmentation at the end of this file).
    p.add_argument("--augment", action="store_true", help="synonym swap + masking of target tokens on the device")
    p.add_argument("--augment-lexicon", default=str(Path(__file__).resolve().parent / "demo_lexicon"),
                   help="folder with synonyms.tsv (+ pos.tsv); default: the demo lexicon")
    p.add_argument("--augment-swap-prob", type=float, default=0.15)
    p.add_argument("--augment-mask-prob", type=float, default=0.05)
    p.add_argument("--augment-mask-token", help="mask token (default: the tokenizer's unk token)")
    p.add_argument("--neftune-alpha", type=float, default=None, help="NEFTune embedding noise (5-15 typical)")
    args = p.parse_args(argv)
    for k, v in (DEMO_DEFAULTS if args.demo else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not args.demo and (args.model is None or args.data is None):
        p.error("--model and --data are required (or use --demo)")
    return args


def setup_distributed():
    """(rank, world_size, device); initialises torch.distributed under torchrun."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    torch.manual_seed(args.seed + rank)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    log = print if rank == 0 else (lambda *a, **k: None)

    if args.demo:
        from _demo_assets import make_demo_assets  # examples/_demo_assets.py

        if rank == 0:
            make_demo_assets(out / "demo")
        if world > 1:
            torch.distributed.barrier()
        args.model, args.data, args.format = str(out / "demo" / "base"), [str(out / "demo" / "data")], "chat"

    # 1. base model + tokenizer. Weights load straight into the compute dtype, tensor by tensor.
    load_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = load_pretrained(args.model, dtype=load_dtype, device=device)
    tok = load_tokenizer(args.model)
    if args.grad_ckpt:
        model.set_gradient_checkpointing(every=1, part="block")

    # 2. adapters. With --qlora the targeted base weights become NF4 (4 bits + fp32 absmax / 64).
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    lcfg = LoRAConfig(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, target_modules=targets,
                      use_rslora=args.rslora, use_dora=args.dora, quantize="nf4" if args.qlora else None,
                      double_quant=args.qlora)
    apply_lora(model, lcfg, verbose=False)
    model.to(device)  # adapter weights were created on the base's device; no-op there
    log(f"trainable parameters: {count_params(model)}")
    augment_step = setup_augmentation(args, tok, model, device, rank, log)  # None without the flags

    # 3. data: tokenize once (cached, fingerprinted), pack rows of seq_len without cross-document attention.
    template = args.chat_template or tok.chat_template or "chatml"
    fcfg = FormatConfig(kind=args.format, chat_template=None if args.format == "text" else template,
                        eos_token=tok.eos_token, bos_token=tok.bos_token, max_length=args.seq_len)
    if rank == 0:  # one rank tokenizes; the others open the finished cache
        build_cache(args.data, tok.tokenizer, fcfg, str(out / "cache"), num_proc=args.num_proc, progress=True)
    if world > 1:
        torch.distributed.barrier()
    cache = build_cache(args.data, tok.tokenizer, fcfg, str(out / "cache"), num_proc=1, progress=False)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    loader = TokenLoader(cache, batch_size=args.batch_size, seq_len=args.seq_len, pad_id=pad_id, packing=True,
                         seed=args.seed, num_workers=args.num_workers, pin_memory=device.type == "cuda")
    log(f"data: {len(cache)} documents, {len(loader)} micro-batches/epoch/rank, packing {loader.pack_stats}")

    # 4. optimizer (token-weighted accumulation), clipper, schedule. The loss module is what DDP
    # wraps: its forward must run through DDP for gradients to be averaged across ranks.
    train_model = CausalLMLoss(model)
    if world > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            train_model, device_ids=[device.index] if device.type == "cuda" else None)
    groups = param_groups(model, lr=args.lr, weight_decay=args.weight_decay, lora_plus_ratio=args.lora_plus)
    opt = TrainOptimizer(make_adamw(groups, lr=args.lr, weight_decay=args.weight_decay), precision=precision)
    clipper = GlobalNormClipper(args.clip)
    steps_per_epoch = len(loader) // args.grad_accum
    total = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    if total < 1:
        raise SystemExit(f"not enough data for one optimizer step ({len(loader)} micro-batches, "
                         f"--grad-accum {args.grad_accum})")
    warmup = resolve_warmup(total, warmup_ratio=args.warmup_ratio)
    if args.schedule == "plateau":
        schedule = PlateauCosine(total=total, warmup=warmup, min_lr_ratio=0.1)
    else:
        schedule = WarmupDecay(total=total, warmup=warmup, decay=args.schedule, min_lr_ratio=0.1)
    sched = LRScheduler(opt.optimizer, schedule)

    # 5. the loop.
    step, t0, tokens_seen, logs = 0, time.perf_counter(), 0, []
    train_model.train()
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        it = iter(loader)
        for _ in range(steps_per_epoch):
            if step >= total:
                break
            for micro in range(args.grad_accum):
                batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
                         for k, v in next(it).items()}
                if augment_step is not None:  # fresh on every micro-batch, keyed by (seed + rank, micro index)
                    batch = augment_step(batch, step * args.grad_accum + micro)
                last = micro == args.grad_accum - 1
                sync = opt.grad_sync(train_model, enabled=last) if world > 1 else nullcontext()
                with sync:
                    with opt.autocast():
                        loss_sum, n_tok = train_model(batch)
                    opt.backward(loss_sum, n_tok)
            res = opt.step(clipper)
            sched.step(1, loss=res.loss)
            step += 1
            tokens_seen += res.num_tokens
            if step % args.log_every == 0 or step == total:
                dt = time.perf_counter() - t0
                rec = {"step": step, "loss": round(res.loss, 4), "lr": sched.get_last_lr()[0],
                       "grad_norm": round(res.grad_norm, 4), "skipped": opt.skipped_steps,
                       "tokens_per_s": round(tokens_seen / dt, 1)}
                logs.append(rec)
                log(json.dumps(rec))
    if world > 1:
        torch.distributed.barrier()

    # 6. save: the adapter in PEFT's format; optionally a merged bf16 checkpoint for serving.
    if rank == 0:
        adapter_dir = save_adapter(model, out / "adapter", base_model_name_or_path=args.model)
        (out / "train_log.json").write_text(json.dumps(logs, indent=1))
        log(f"adapter saved to {adapter_dir}")
        if args.demo:
            _demo_sample(model, tok, template, device)
        if args.save_merged:
            merged = merge_and_unload(model, dtype=torch.bfloat16)
            save_pretrained(merged, out / "merged")
            tok_files = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
            for name in tok_files:
                src = Path(args.model) / name
                if src.exists():
                    (out / "merged" / name).write_bytes(src.read_bytes())
            log(f"merged checkpoint saved to {out / 'merged'}")
    if world > 1:
        torch.distributed.destroy_process_group()
    return model, logs


class CausalLMLoss(torch.nn.Module):
    """batch -> (summed token loss, target-token count), without materialising [B, T, V] logits."""

    KEYS = ("position_ids", "cu_seqlens", "max_seqlen", "attention_mask")  # the batch contract of ftlib.data.collate

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        hidden = self.model.model(batch["input_ids"], **{k: batch[k] for k in self.KEYS if k in batch})
        return chunked_cross_entropy(hidden, self.model.lm_head.weight, batch["labels"])


def setup_augmentation(args, tok, model, device, rank, log):
    """``--augment`` / ``--neftune-alpha``: a function (batch on the device, micro step) -> batch, or None.

    The synonym table and POS lexicon are built from the TSV folder through the tokenizer (the
    coverage report says what was dropped), moved to the device once, and applied to the target
    tokens of every micro-batch (ftlib.augment). NEFTune adds noise to the input embeddings with
    each packed document's own length (ftlib.embed_noise).
    """
    if not args.augment and not args.neftune_alpha:
        return None
    from ftlib.augment import AugmentConfig, augment, load_lexicon_dir, resolve_token_id
    from ftlib.embed_noise import EmbeddingNoise

    tables = None
    if args.augment:
        syn, lex = load_lexicon_dir(tok, args.augment_lexicon, vocab_size=model.config.vocab_size)
        log(syn.coverage.summary())
        log(lex.coverage.summary())
        mask_id = None
        if args.augment_mask_prob > 0:
            name = args.augment_mask_token or tok.unk_token
            if name is None:
                raise SystemExit("--augment-mask-prob > 0 needs --augment-mask-token (this tokenizer has no unk token)")
            mask_id = resolve_token_id(tok, name)
        cfg = AugmentConfig(swap_prob=args.augment_swap_prob, mask_prob=args.augment_mask_prob, mask_token_id=mask_id)
        tables = (syn.to(device), lex.to(device), cfg)
    noise = (EmbeddingNoise.attach(model, neftune_alpha=args.neftune_alpha, seed=args.seed + rank)
             if args.neftune_alpha else None)

    def step(batch, micro_step):
        if tables is not None:
            batch = augment(batch, *tables, seed=args.seed + rank, step=micro_step)
        if noise is not None:
            noise.set_batch(batch, step=micro_step)
        return batch

    return step


@torch.no_grad()
def _demo_sample(model, tok, template, device):
    from ftlib.data import render_chat

    model.eval()
    prompt = render_chat([{"role": "user", "content": "What is 3 plus 4?"}], template, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)], device=device)
    stop = [t for t in (tok.eos_token_id, tok.tokenizer.token_to_id("<|im_end|>")) if t is not None]
    new = generate(model, ids, max_new_tokens=12, stop_tokens=stop)
    print(f"sample: {prompt!r} -> {tok.decode(new[0].tolist())!r}")
    model.train()


if __name__ == "__main__":
    main()
