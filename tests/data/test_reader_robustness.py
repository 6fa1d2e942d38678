"""Bad records of any kind cost only themselves: a lone surrogate, JSON nested 100,000 deep, a record the
formatter or tokenizer fails on — strict mode stops with one line naming file:line, lenient mode skips
and counts it there and keeps the good records. And a corpus of more files than open handles allowed."""

import json
import os
import subprocess
import sys

import pytest

from ftlib.data import DataError, FormatConfig, build_cache

CHAT = FormatConfig(kind="chat", chat_template="chatml")
GOOD = json.dumps({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]})
SURROGATE = '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "x"}]}'
DEEP = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"


def _build(tmp_path, tokenizer, lines, strict, name="d.jsonl", cfg=CHAT):
    src = tmp_path / name
    src.write_text("\n".join(lines) + "\n")
    return build_cache(str(src), tokenizer, cfg, str(tmp_path / f"c-{strict}"), strict=strict, progress=False)


@pytest.mark.parametrize("bad,reason", [(SURROGATE, "invalid_unicode"), (DEEP, "malformed_json")],
                         ids=["lone_surrogate", "nested_100000_deep"])
def test_a_bad_record_is_one_line_in_strict_mode_and_skipped_with_its_line_in_lenient(tmp_path, tokenizer, bad,
                                                                                      reason):
    lines = [GOOD, bad, GOOD]
    with pytest.raises(DataError) as e:
        _build(tmp_path, tokenizer, lines, strict=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / 'd.jsonl'}:2: {reason}")
    c = _build(tmp_path, tokenizer, lines, strict=False)
    assert len(c) == 2 and c.report.counts == {reason: 1}
    assert c.report.examples[reason][0].startswith(f"{tmp_path / 'd.jsonl'}:2:")


def test_a_lone_surrogate_in_a_json_document_is_skipped_with_its_line(tmp_path, tokenizer):
    src = tmp_path / "d.json"
    src.write_text("[" + GOOD + ",\n" + SURROGATE + ",\n" + GOOD + "]")
    c = build_cache(str(src), tokenizer, CHAT, str(tmp_path / "c"), strict=False, progress=False)
    assert len(c) == 2 and c.report.examples["invalid_unicode"][0].startswith(f"{src}:2:")


def test_any_exception_from_one_record_costs_that_record_only(tmp_path, tokenizer):
    # a template that fails on one record with an error the formatter does not expect (raised while encoding)
    class Boom(FormatConfig):
        def formatter(self, tok):
            fmt = super().formatter(tok)
            real = fmt._encode_batch

            def encode(texts, offsets):
                if any("boom" in t for t in texts):
                    raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
                return real(texts, offsets)

            fmt._encode_batch = encode
            return fmt

    bad = json.dumps({"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]})
    cfg = Boom(kind="chat", chat_template="chatml")
    with pytest.raises(DataError, match=r"d\.jsonl:2: format_error: TypeError: TextEncodeInput"):
        _build(tmp_path, tokenizer, [GOOD, bad, GOOD], strict=True, cfg=cfg)
    c = _build(tmp_path, tokenizer, [GOOD, bad, GOOD], strict=False, cfg=cfg)
    assert len(c) == 2 and c.report.counts == {"format_error": 1}


def test_more_one_record_files_than_open_handles_allowed(tmp_path, tokenizer):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(1500):
        (data / f"{i:05d}.jsonl").write_text(GOOD + "\n")
    tok = tmp_path / "tokenizer.json"
    tokenizer.save(str(tok))
    code = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
from tokenizers import Tokenizer
from ftlib.data import FormatConfig, TokenLoader, build_cache, open_cache
cfg = FormatConfig(kind="chat", chat_template="chatml")
c = build_cache({str(data)!r}, Tokenizer.from_file({str(tok)!r}), cfg, {str(tmp_path / 'c')!r}, progress=False)
c = open_cache({str(tmp_path / 'c')!r}, verify="full")
n = sum(len(b["input_ids"]) for b in TokenLoader(c, batch_size=4, seq_len=64, pad_id=0))
print(len(c), n)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == "1500"
