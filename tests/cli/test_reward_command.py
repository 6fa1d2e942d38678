"""End to end, ``ftlib reward``: the demo learns (held-out accuracy rises), writes the rewards into the
pairs files, and its files load in transformers (merged model) and peft (decayed LoRA adapter) with equal scores."""

import json
import sys

import pytest
import torch

from ftlib.cli import reward


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend on a shared machine
    try:
        out = tmp_path_factory.mktemp("rm")
        model, metrics = reward.train(["--demo", "--out", str(out), "--max-steps", "120", "--log-every", "40",
                                            "--decay-rank", "8", "--decay-at", "0.75", "--offload-blocks", "1",
                                            "--onpolicy-policy", str(out / "demo" / "base")])
    finally:
        torch.set_num_threads(n)
    return out, model, metrics


def _docs(out, n=6):
    from ftlib.data import render_chat
    from ftlib.models import load_tokenizer

    tok = load_tokenizer(out / "demo" / "base")
    recs = [json.loads(line) for line in (out / "scored" / "eval.jsonl").read_text().splitlines()][:n]
    docs = [tok.encode(render_chat(r["messages"] + [{"role": "assistant", "content": r["chosen"]}], tok.chat_template),
                       add_special_tokens=False) for r in recs]
    return tok, recs, docs


def _padded(docs, pad):
    t = max(map(len, docs))
    ids = torch.full((len(docs), t), pad)
    mask = torch.zeros(len(docs), t, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = torch.tensor(d), 1
    return ids, mask


def test_onpolicy_pairs_are_the_policys_answers_scored_by_the_reward_model(run):
    """--onpolicy-policy: pairs of the policy's own answers to the training prompts, each side's reward the
    trained reward model's score of the rendered conversation; two different sides, the chosen scored higher."""
    from ftlib.data import render_chat
    from ftlib.models import load_tokenizer, score

    out, model, m = run
    recs = [json.loads(line) for line in (out / "onpolicy" / "pairs.jsonl").read_text().splitlines()]
    train_prompts = {json.dumps(json.loads(line)["messages"])
                     for line in (out / "demo" / "pairs" / "train.jsonl").read_text().splitlines()}
    assert m["onpolicy"]["pairs"] == len(recs) > 0 and m["onpolicy"]["prompts"] == len(train_prompts)
    assert {json.dumps(r["messages"]) for r in recs} <= train_prompts
    assert all(" ".join(r["chosen"].split()) != " ".join(r["rejected"].split()) for r in recs)
    assert all(r["reward_chosen"] > r["reward_rejected"] for r in recs)
    tok = load_tokenizer(out / "demo" / "base")
    docs = [tok.encode(render_chat(r["messages"] + [{"role": "assistant", "content": r[side]}], tok.chat_template),
                       add_special_tokens=False) for r in recs[:8] for side in ("chosen", "rejected")]
    want = score(model, docs).tolist()
    got = [r[f"reward_{side}"] for r in recs[:8] for side in ("chosen", "rejected")]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)


def test_demo_accuracy_rises_and_rewards_are_written(run):
    out, model, m = run
    print(f"held-out pairwise accuracy: before {m['accuracy_before']:.3f}, after {m['accuracy_after']:.3f} "
          f"({m['eval_pairs']} held-out pairs, {m['train_pairs']} training pairs)")
    assert m["accuracy_after"] >= m["accuracy_before"] + 0.15 and m["accuracy_after"] >= 0.65
    assert m["ranks"] == [8]
    for name in ("train", "eval"):
        recs = [json.loads(line) for line in (out / "scored" / f"{name}.jsonl").read_text().splitlines()]
        src = [json.loads(line) for line in (out / "demo" / "pairs" / f"{name}.jsonl").read_text().splitlines()]
        assert len(recs) == len(src)
        for r, s in zip(recs, src):
            assert {k: r[k] for k in s} == s  # every input field kept
            assert isinstance(r["reward_chosen"], float) and isinstance(r["reward_rejected"], float)
    acc = sum(r["reward_chosen"] > r["reward_rejected"] for r in recs) / len(recs)
    assert acc == pytest.approx(m["accuracy_after"], abs=1 / len(recs))  # the file holds the evaluated scores


def test_merged_reward_model_loads_in_transformers_with_the_files_scores(run):
    transformers = pytest.importorskip("transformers")
    out, model, _ = run
    tok, recs, docs = _docs(out)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out / "reward_model").eval()
    ids, mask = _padded(docs, tok.pad_token_id)
    with torch.no_grad():
        got = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    want = torch.tensor([r["reward_chosen"] for r in recs])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_decayed_adapter_loads_in_peft_with_equal_scores(run):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    out, model, _ = run
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["task_type"] == "SEQ_CLS" and cfg["r"] == 16 and set(cfg["rank_pattern"].values()) == {8}
    tok, recs, docs = _docs(out)
    base = transformers.AutoModelForSequenceClassification.from_pretrained(out / "demo" / "base", num_labels=1)
    base.config.pad_token_id = tok.pad_token_id
    pm = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    ids, mask = _padded(docs, tok.pad_token_id)
    with torch.no_grad():
        got = pm(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(got, torch.tensor([r["reward_chosen"] for r in recs]), atol=1e-4, rtol=1e-4)


def test_bad_pairs_file_names_the_line(run, tmp_path):
    """Pairs are read by the preference pipeline (ftlib.data.pairs) for scoring too: a bad record names
    its file, line and field (strict), or is left out and counted (lenient)."""
    from ftlib.data import DataError, PairConfig, SkipReport
    from ftlib.evaluation import score_pairs
    from ftlib.models import load_tokenizer

    out, model, _ = run
    tok = load_tokenizer(out / "demo" / "base")
    cfg = PairConfig(kind="chat", chat_template=tok.chat_template)
    f = tmp_path / "p.jsonl"
    good = '{"messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}\n'
    f.write_text(good + '{"messages": [{"role": "user", "content": "q"}], "chosen": "a"}\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: .*field 'rejected'"):
        score_pairs(model, tok, str(f), cfg)
    report = SkipReport(strict=False)
    assert len(score_pairs(model, tok, str(f), cfg, report=report)) == 1 and report.counts == {"missing_field": 1}
    f.write_text('{"messages": [{"role": "user"}], "chosen": "a", "rejected": "b"}\n')
    with pytest.raises(DataError, match=r"p.jsonl:1: .*field 'messages'"):
        score_pairs(model, tok, str(f), cfg)
    f.write_text(good.replace("}\n", ', "margin": "x"}\n'))
    with pytest.raises(DataError, match=r"p.jsonl:1: .*field 'margin' must be a finite number"):
        score_pairs(model, tok, str(f), cfg)


def _adapter_tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def test_cut_run_resumes_to_the_same_weights_and_evals_at_eval_every(tmp_path, monkeypatch):
    """--save-every / --resume: a run cut after its step-8 checkpoint and resumed ends with the same adapter
    (bitwise, CPU), the same log and the same held-out evals as an uninterrupted one; evals at every
    --eval-every step, the step-0 point and the last step; run.json records the resume and the template."""
    from ftlib.checkpoint import Checkpointer

    rm = reward
    n = torch.get_num_threads()
    common = ["--demo", "--demo-prompts", "8", "--max-steps", "12", "--batch-size", "4", "--save-every", "4",
              "--eval-every", "3", "--log-every", "2", "--threads", "1"]
    try:
        _, full = rm.train(common + ["--out", str(tmp_path / "full")])

        class Cut(Checkpointer):
            def save(self, step, **kw):
                path = super().save(step, **kw)
                if step == 8:
                    self.close()
                    raise KeyboardInterrupt
                return path

        monkeypatch.setattr(rm, "Checkpointer", Cut)
        with pytest.raises(KeyboardInterrupt):
            rm.train(common + ["--out", str(tmp_path / "cut")])
        monkeypatch.setattr(rm, "Checkpointer", Checkpointer)
        _, resumed = rm.train(common + ["--out", str(tmp_path / "cut"), "--resume"])
    finally:
        torch.set_num_threads(n)
    a, b = _adapter_tensors(tmp_path / "full" / "adapter"), _adapter_tensors(tmp_path / "cut" / "adapter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    untimed = lambda log: [{k: v for k, v in r.items() if k != "pairs_per_s"} for r in log]
    assert [r["step"] for r in full["log"]] == list(range(2, 13, 2))
    assert untimed(resumed["log"]) == untimed(full["log"])
    assert [e["step"] for e in full["evals"]] == [0, 3, 6, 9, 12]
    assert resumed["evals"] == full["evals"] and resumed["accuracy_before"] == full["accuracy_before"]
    run = json.loads((tmp_path / "cut" / "run.json").read_text())
    assert len(run["resumes"]) == 1 and run["resumes"][0]["step"] == 8
    tok_cfg = json.loads((tmp_path / "cut" / "demo" / "base" / "tokenizer_config.json").read_text())
    assert run["chat_template"]["text"] == tok_cfg["chat_template"]
    for folder in ("adapter", "reward_model", "checkpoints/step-00000012"):
        saved = json.loads((tmp_path / "cut" / folder / "tokenizer_config.json").read_text())
        assert saved["chat_template"] == tok_cfg["chat_template"], folder


def test_cli_refuses_no_template_and_bad_records_in_one_line_and_lenient_skips(tmp_path):
    """No chat template (tokenizer without one, no --chat-template): refused, one line, exit 2, saying how
    to pass one. A malformed record: one line naming file:line and --lenient; the old --pairs flag is gone.
    --lenient trains on the good records, counts the bad one in skipped.json, saves the template used."""
    import subprocess

    from ftlib.data import BUILTIN_TEMPLATES
    from ftlib.train.demo import make_demo_assets

    make_demo_assets(tmp_path / "demo")
    base = tmp_path / "demo" / "base"
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in base.glob("chat_template.jinja"):
        f.unlink()
    good = '{"messages": [{"role": "user", "content": "1+1"}], "chosen": "2", "rejected": "3"}\n'
    data = tmp_path / "pairs.jsonl"
    data.write_text(good * 3 + '{"messages": [{"role": "user", "content": "q"}], "chosen": "a"}\n' + good)
    argv = ["--model", str(base), "--data", str(data), "--out", str(tmp_path / "o"), "--max-steps", "2",
            "--batch-size", "2", "--threads", "1"]

    def cli(*extra):
        return subprocess.run([sys.executable, "-m", "ftlib", "reward", *argv, *extra], capture_output=True,
                              text=True, timeout=300)

    r = cli()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "no chat template" in r.stderr and "--chat-template" in r.stderr
    r = cli("--chat-template", "chatml")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "pairs.jsonl:4" in r.stderr and "field 'rejected'" in r.stderr and "--lenient" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ftlib", "reward", "--pairs", str(data), "--out", "x"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unrecognized arguments: --pairs" in r.stderr

    rm = reward
    n = torch.get_num_threads()
    try:
        _, m = rm.train(argv + ["--chat-template", "chatml", "--lenient", "--eval-data", str(data), "--eval-every", "1",
                               "--log-every", "1", "--report-to", "tensorboard"])
    finally:
        torch.set_num_threads(n)
    assert m["train_pairs"] == 4 and m["skipped_records"]["train"] == 1 and m["steps"] == 2
    skipped = json.loads((tmp_path / "o" / "skipped.json").read_text())
    assert skipped["train"]["counts"] == {"missing_field": 1}
    saved = json.loads((tmp_path / "o" / "adapter" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == BUILTIN_TEMPLATES["chatml"]
    run = json.loads((tmp_path / "o" / "run.json").read_text())
    assert run["chat_template"]["source"] == "built-in 'chatml'" and run["args"]["lenient"] is True
    assert [e["step"] for e in m["evals"]] == [0, 1, 2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "o" / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("train/loss")] == [1, 2]
    assert [e.step for e in tb.Scalars("eval/eval_accuracy")] == [0, 1, 2]
    assert [e.value for e in tb.Scalars("eval/eval_loss")] == pytest.approx([e["eval_loss"] for e in m["evals"]])


def test_resume_does_not_warn_about_the_tokenizer_files_ftlib_put_beside_the_checkpoint(tmp_path):
    """Issue 34, item 10: every checkpoint folder gets the tokenizer files (so its adapter serves as it is);
    they are not in the checkpoint's marker, and a resume warned about them (CheckpointWarning, twice).
    ftlib's own files draw no warning; a file someone else copied in still does, once."""
    import shutil
    import warnings

    from ftlib.checkpoint import CheckpointWarning

    rm = reward
    n = torch.get_num_threads()
    common = ["--demo", "--demo-prompts", "4", "--max-steps", "4", "--batch-size", "4", "--save-every", "2",
              "--threads", "1"]
    try:
        rm.train(common + ["--out", str(tmp_path / "run")])
        ckpts = tmp_path / "run" / "checkpoints"
        shutil.rmtree(ckpts / "step-00000004")
        assert (ckpts / "step-00000002" / "tokenizer_config.json").is_file()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rm.train(common + ["--out", str(tmp_path / "run"), "--resume"])
        assert not [w for w in caught if issubclass(w.category, CheckpointWarning)], [str(w.message) for w in caught]
        shutil.rmtree(ckpts / "step-00000004")
        (ckpts / "step-00000002" / "notes.txt").write_text("mine")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rm.train(common + ["--out", str(tmp_path / "run"), "--resume"])
        stray = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
        assert len(stray) == 1 and "notes.txt" in stray[0] and "tokenizer" not in stray[0], stray
    finally:
        torch.set_num_threads(n)
