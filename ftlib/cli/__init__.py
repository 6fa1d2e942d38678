"""The ``ftlib`` command (installed by pip; also ``python -m ftlib``): the full fine-tuning jobs.

    ftlib sft --demo --out runs/demo                     # LoRA SFT on the built-in tiny data
    ftlib sft --model meta-llama/Llama-3.1-8B --data chat.jsonl --out runs/x --qlora
    ftlib dpo --model runs/x/merged --data pairs.jsonl --out runs/dpo
    ftlib reward --model ... --data pairs.jsonl --out runs/rm
    ftlib grpo --demo --out runs/grpo
    ftlib data build --source data/ --tokenizer models/llama3/ --out cache/
    ftlib data info cache/
    ftlib memory --model meta-llama-3-8b/ --gpus 1 2 4 8

Each subcommand is one module with a ``main(argv) -> int``; ``ftlib <command> --help`` lists its
flags. The loops these commands run are written out, short, in ``examples/`` (the files people
read and copy); the commands add every flag, config file, resume rule, lenient mode, logger and
multi-GPU engine around the same library calls.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "main"]

# command -> (module holding ``main(argv)``, argv prefix passed before the user's, one-line help)
COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "sft": ("ftlib.cli.sft", (), "supervised fine-tuning: LoRA / QLoRA / DoRA / full, one GPU or torchrun"),
    "dpo": ("ftlib.cli.dpo", (), "preference tuning: DPO / IPO / SimPO / ORPO / ... on chosen/rejected pairs"),
    "reward": ("ftlib.cli.reward", (), "a Bradley-Terry reward model on chosen/rejected pairs"),
    "grpo": ("ftlib.cli.grpo", (), "online RL with verifiable rewards: GRPO / Dr. GRPO / DAPO"),
    "data": ("ftlib.data.__main__", (), "build an Arrow token cache from sources (build), or describe one (info)"),
    "memory": ("ftlib.distributed.__main__", ("memory",), "per-GPU memory of full / LoRA / QLoRA fine-tuning"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items())
    return f"usage: ftlib <command> [flags]   (ftlib <command> --help for its flags)\n\ncommands:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    """Run ``ftlib <command> ...``; returns the exit status (2 with a one-line error on a bad command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from ftlib import __version__

        print(f"ftlib {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"ftlib: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}\n")
        return 2
    module, prefix, _ = COMMANDS[name]
    rc = importlib.import_module(module).main([*prefix, *rest])
    return int(rc or 0)
