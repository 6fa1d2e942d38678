"""``ftlib sft --demo`` with ``--augment`` (demo lexicon) and ``--neftune-alpha``: the loop trains on
augmented batches (target tokens swapped or masked, prompts untouched) with noisy embeddings."""

import math

import torch

from ftlib.cli import sft


def test_demo_finetune_with_augmentation_and_neftune(tmp_path, monkeypatch, capsys):
    seen = []
    real_setup = sft.setup_augmentation

    def spy(*args, **kwargs):
        step = real_setup(*args, **kwargs)

        def wrapped(batch, micro_step):
            before = {k: v.clone() for k, v in batch.items() if torch.is_tensor(v)}
            out = step(batch, micro_step)
            seen.append((micro_step, before, out))
            return out

        return wrapped

    monkeypatch.setattr(sft, "setup_augmentation", spy)
    model, logs = sft.run(["--demo", "--out", str(tmp_path / "run"), "--max-steps", "2", "--log-every", "1",
                           "--num-proc", "1", "--num-workers", "0", "--augment", "--neftune-alpha", "5", "--grad-accum", "2",
                           "--augment-swap-prob", "0.5", "--augment-mask-prob", "0.1"])
    printed = capsys.readouterr().out
    assert "synonyms coverage: 16/23 words kept" in printed and "word not a single token): happy" in printed
    assert len(logs) == 2 and all(math.isfinite(r["loss"]) and r["skipped"] == 0 for r in logs)
    assert [m for m, _, _ in seen] == [0, 1, 2, 3]  # every micro-batch, keyed by its global index
    unk = 0  # the demo's mask token: <unk>, id 0
    n_swapped = n_masked = 0
    for _, before, out in seen:
        ids, new, labels = before["input_ids"], out["input_ids"], before["labels"]
        assert torch.equal(new[labels == -100], ids[labels == -100])  # prompts, first tokens, padding
        assert torch.equal(out["labels"], labels)  # targets stay the original tokens
        n_masked += int(((new != ids) & (new == unk)).sum())
        n_swapped += int(((new != ids) & (new != unk)).sum())
    assert n_swapped > 0 and n_masked > 0
    hooks = model.model.embed_tokens._forward_hooks
    assert len(hooks) == 1  # NEFTune is attached to the input embedding
