"""End to end: the demo fine-tune trains, lowers the loss, and its PEFT-format adapter reloads exactly."""

import json
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_demo_finetune_learns_and_adapter_round_trips(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import finetune_lora

    out = tmp_path / "run"
    model, logs = finetune_lora.main(["--demo", "--out", str(out), "--max-steps", "40", "--log-every", "1",
                                      "--num-proc", "1", "--num-workers", "0"])
    assert len(logs) == 40 and all(r["skipped"] == 0 for r in logs)
    first = sum(r["loss"] for r in logs[:5]) / 5
    last = sum(r["loss"] for r in logs[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 16

    # The saved adapter, loaded onto a fresh copy of the base, reproduces the trained model.
    from ftlib.lora import load_adapter
    from ftlib.models import load_pretrained

    base = out / "demo" / "base"
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    reloaded = load_adapter(load_pretrained(base), out / "adapter", check_base=False).eval()
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(reloaded(ids), want, atol=1e-5, rtol=1e-5)
        assert (load_pretrained(base)(ids) - want).abs().max() > 1e-2, "the adapter changed nothing"
    sys.modules.pop("finetune_lora", None)
