"""One builder per cache directory: a second ``python -m ftlib.data build --out D`` waits for the first,
saying whose build it waits for, and both summaries describe what D then holds.

The first builder is held inside its build deterministically (a formatter that waits for the test's
signal, through the cache's formatter hook); the second is the command line, as a user runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ftlib.data import build_cache, open_cache
from ftlib.data.formatting import FormattedDoc

ROOT = Path(__file__).resolve().parents[2]
_STARTED, _GO = threading.Event(), threading.Event()


@dataclass(frozen=True)
class _HeldConfig:
    """Text documents whose first record waits for ``_GO`` (the build is then inside its lock)."""

    kind: str = "held-text"

    def fingerprint(self) -> str:
        return hashlib.sha256(b"held-text").hexdigest()

    def formatter(self, tokenizer):
        def fmt(record, where, report):
            _STARTED.set()
            assert _GO.wait(300), "the test never released the first build"
            ids = np.asarray(tokenizer.encode(record["text"], add_special_tokens=False).ids, np.int64)
            return FormattedDoc(ids, np.ones(len(ids), np.uint8), False)

        return fmt


def test_second_builder_waits_naming_the_holder_and_both_summaries_hold(tmp_path, tokenizer, write_jsonl):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"first source record {i}"} for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"second source, record {i}"} for i in range(5)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "cache"
    first: dict = {}

    def build_first():
        try:
            c = build_cache(a, tokenizer, _HeldConfig(), str(out), num_proc=1, progress=False)
            first["n_docs"] = len(c)
        except BaseException as e:  # surfaced by the assertions below
            first["error"] = e

    _STARTED.clear()
    _GO.clear()
    t = threading.Thread(target=build_first)
    t.start()
    try:
        assert _STARTED.wait(120), first
        err = open(tmp_path / "second.err", "w+")
        p = subprocess.Popen([sys.executable, "-m", "ftlib.data", "build", "--source", b, "--tokenizer",
                              str(tmp_path / "tokenizer.json"), "--out", str(out), "--kind", "text", "--eos-token",
                              "</s>", "--num-proc", "1", "--no-progress"],
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, stderr=err, text=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "waiting" not in Path(err.name).read_text() and p.poll() is None:
            time.sleep(0.2)
        said = Path(err.name).read_text()
        assert p.poll() is None, f"the second builder ran while the first held the cache (rc {p.returncode}): {said}"
        assert "another build holds this cache directory" in said and f"pid {os.getpid()}" in said, said
    finally:
        _GO.set()
        t.join(300)
    stdout, _ = p.communicate(timeout=300)
    assert p.returncode == 0, Path(err.name).read_text()[-2000:]
    assert first == {"n_docs": 3}, first  # the first summary: its own 3 documents, read before the second wrote
    assert f"cache {out}: 5 documents" in stdout, stdout  # the second: its 5, which the directory now holds
    info = json.loads(subprocess.run([sys.executable, "-m", "ftlib.data", "info", str(out)], capture_output=True,
                                     text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True).stdout)
    assert info["n_docs"] == 5 and len(open_cache(str(out))) == 5
