"""``ftlib sft --model`` on tiny Qwen3, Gemma-3 and Phi-3 folders (written by transformers,
the demo's tokenizer and data, each family's chat template): it trains, lowers nothing it should not, and
its adapter loads in PEFT on the transformers model with ftlib's logits. The assistant-only loss mask of
each template is checked token by token in ``tests/data/test_formatting.py`` (gemma, gemma3, phi3, qwen2),
``tests/data/test_gemma3_template.py`` (Gemma-3's hub file) and ``tests/data/test_qwen3_thinking.py``
(Qwen3's, against transformers' rendering)."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from ftlib.cli import sft  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "data"))
from _chat_templates import GEMMA3, PHI3, QWEN2, QWEN3  # noqa: E402

SIZES = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True), QWEN3, "<|im_end|>"),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16), GEMMA3,
               "<eos>"),
    "phi3": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2), PHI3, "<|end|>"),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from ftlib.train.demo import make_demo_assets

    return make_demo_assets(tmp_path_factory.mktemp("assets"), n_records=64)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_finetune_cli_on_family(family, assets, tmp_path):
    from tokenizers import Tokenizer

    cfg_name, extra, template, eos = FAMILIES[family]
    vocab = Tokenizer.from_file(str(assets / "base" / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cfg_name)(vocab_size=vocab, **SIZES,
                                                                                       **extra))
    folder = tmp_path / family
    hf.save_pretrained(folder)
    shutil.copy(assets / "base" / "tokenizer.json", folder)
    tcfg = json.loads((assets / "base" / "tokenizer_config.json").read_text())
    tcfg.update(chat_template=template)  # the demo vocabulary has <|im_end|> as its EOS (kept)
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg))
    out = tmp_path / "run"
    model, logs = sft.run(["--model", str(folder), "--data", str(assets / "data"), "--kind", "chat",
                           "--out", str(out), "--max-steps", "3", "--num-proc", "1", "--num-workers", "0",
                           "--log-every", "1", "--seq-len", "128"])
    assert [r["step"] for r in logs] == [1, 2, 3] and all(r["loss"] == r["loss"] for r in logs)
    pm = peft.PeftModel.from_pretrained(hf.eval(), out / "adapter").eval()
    ids = torch.randint(0, vocab, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), pm(ids).logits, atol=1e-5, rtol=1e-5)


def test_unsupported_model_type_is_a_usage_error(assets, tmp_path, capsys):
    folder = tmp_path / "m"
    shutil.copytree(assets / "base", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "su", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        sft.main(["--model", str(folder), "--data", str(assets / "data"), "--kind", "chat",
                  "--out", str(tmp_path / "run"), "--max-steps", "1", "--num-proc", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "rope_type 'su' is not supported" in err and "Traceback" not in err


CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why is the sky blue"},
        {"role": "assistant", "content": "because of scattering"}, {"role": "user", "content": "and red"},
        {"role": "assistant", "content": " at dusk\n"}]


@pytest.mark.parametrize("template,prefix,turn_end,strip", [
    (GEMMA3, "<start_of_turn>model\n", "<end_of_turn>", True),
    (PHI3, "<|assistant|>\n", "<|end|>", False),
    (QWEN2, "<|im_start|>assistant\n", "<|im_end|>", False),
])
def test_assistant_mask_of_family_templates(template, prefix, turn_end, strip, assets):
    """Token by token: the loss tokens are exactly each assistant turn and its turn end (Gemma-3: with the
    system text folded into the first user turn, which carries no loss)."""
    from ftlib.data import FormatConfig, Formatter, SkipReport, render_chat
    from ftlib.models import load_tokenizer

    tok = load_tokenizer(assets / "base")
    # the families' turn markers are special tokens in their own vocabularies, as <|im_end|> is in the demo's
    tok.tokenizer.add_special_tokens(["<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<|end|>",
                                      "<|system|>"])
    cfg = FormatConfig(kind="chat", chat_template=template, bos_token=None, eos_token="<|im_end|>")
    doc = Formatter(tok.tokenizer, cfg)({"messages": CONV}, "x:1", SkipReport())
    text = render_chat(CONV, template, bos_token="", eos_token="<|im_end|>", add_generation_prompt=False)
    if template is GEMMA3:
        assert "<start_of_turn>user\nbe brief\n\nwhy is the sky blue<end_of_turn>" in text
    bodies = [(m["content"].strip() if strip else m["content"]) + turn_end for m in CONV if m["role"] == "assistant"]
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    assert enc.ids == doc.input_ids.tolist()
    got = {c for (a, b), m in zip(enc.offsets, doc.loss_mask.tolist()) if m for c in range(a, b)}
    want, pos = set(), 0
    for body in bodies:
        i = text.index(prefix + body, pos) + len(prefix)
        want.update(range(i, i + len(body)))
        pos = i + len(body)
    assert got == want
