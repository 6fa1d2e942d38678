"""Byte-level BPE encoding in C++ for the tokenizers that are exactly GPT-2 / Llama-3 / Qwen2 style.

What: ``FastBPE.from_tokenizer(tok)`` reads a Hugging Face ``tokenizers.Tokenizer``'s JSON and, when
every part that shapes ids and offsets is one this encoder reproduces, returns an encoder whose
``encode_batch(texts)`` gives the same token ids and character offsets as
``tok.encode_batch(texts, add_special_tokens=False)``, without building a Python ``Encoding`` (and
its per-token strings) for every text. Otherwise ``from_tokenizer`` raises ``Unsupported`` naming the
part, and callers use ``tokenizers`` itself; ``fast_bpe_for(tok)`` returns None then
(``FTLIB_BPE_BACKEND=auto|cpp|tokenizers`` forces one; ``cpp`` on an unsupported tokenizer raises).

Supported exactly (anything else is ``Unsupported``):

- model ``BPE`` over the byte-level alphabet (all 256 bytes in the vocabulary), merges as pairs
  or ``"a b"`` strings, ``ignore_merges`` either way; no dropout, no subword prefix/suffix;
- normalizer none, or ``NFC`` (a batch with a text that is not already NFC goes to ``tokenizers``:
  normalizing would move its offsets);
- pre-tokenizer ``ByteLevel(add_prefix_space=False, use_regex=True)`` (GPT-2's pattern), or
  ``Sequence[Split(P, "Isolated"), ByteLevel(add_prefix_space=False, use_regex=False)]`` with P
  GPT-2's, Llama-3's (``\\p{N}{1,3}``) or Qwen2's (``\\p{N}``) pattern;
- added tokens without ``lstrip`` / ``rstrip`` / ``single_word``, matched as the added vocabulary
  does: leftmost-longest, those with ``normalized=False`` on the raw text first, then the others in
  the pieces between them (the text being normalized already);
- post-processor none, ``TemplateProcessing`` / ``ByteLevel(trim_offsets=False)`` or a sequence of
  them (with ``add_special_tokens=False`` they change nothing).

The math (``csrc/bpe.cpp``): split out added tokens; pre-tokenize each piece between them with the
pattern's alternation spelled out as a matcher (``\\p{L}``, ``\\p{N}`` are Unicode general categories
L* / N* from Python's ``unicodedata``, ``\\s`` the White_Space property); BPE on each pre-token's
bytes: repeatedly merge the adjacent pair of lowest merge rank (leftmost first) until no adjacent
pair is a merge (``ignore_merges``: a pre-token that is itself in the vocabulary is one token),
cached per distinct pre-token. A token's offsets are the characters its bytes touch.

Reference: ``tokenizers`` (its BPE model, ByteLevel and Split pre-tokenizers, added vocabulary);
``tests/data/test_fast_bpe.py`` checks ids and offsets against it on generated text. Categories come
from Python's Unicode database; code points assigned in a newer Unicode version than the one
``tokenizers``' regex engine carries could classify differently (none in ordinary text).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
import unicodedata

import numpy as np

from .._cbuild import cache_root, load_library

__all__ = ["FastBPE", "Unsupported", "fast_bpe_for"]

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PATTERNS = {GPT2_PATTERN: (0, 0), LLAMA3_PATTERN: (1, 3), QWEN2_PATTERN: (1, 1)}  # (mode, max digits)

# Unicode White_Space (what \s matches in tokenizers' regex engine)
_WHITE_SPACE = [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
                0x205F, 0x3000]


class Unsupported(ValueError):
    """The tokenizer has a part this encoder does not reproduce exactly (the message names it)."""


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=1)
def _unicode_classes() -> np.ndarray:
    """uint8 per code point: 1 = letter (L*), 2 = number (N*), 4 = White_Space; cached on disk."""
    path = os.path.join(cache_root(), "unicode", f"classes-{unicodedata.unidata_version}.bin")
    if os.path.exists(path) and os.path.getsize(path) == 0x110000:
        return np.fromfile(path, np.uint8)
    cat = unicodedata.category
    table = np.fromiter((1 if (k := cat(chr(c))[0]) == "L" else 2 if k == "N" else 0 for c in range(0x110000)),
                        np.uint8, count=0x110000)
    table[_WHITE_SPACE] |= 4
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    table.tofile(tmp)
    os.replace(tmp, path)
    return table


def _post_processor_ok(pp) -> bool:
    if pp is None:
        return True
    kind = pp.get("type")
    if kind == "Sequence":
        return all(_post_processor_ok(p) for p in pp.get("processors", []))
    if kind == "ByteLevel":
        return not pp.get("trim_offsets", True)
    return kind == "TemplateProcessing"


def _byte_level(pt) -> bool:
    return pt.get("type") == "ByteLevel" and not pt.get("add_prefix_space", True)


def _parse(spec: dict) -> dict:
    """The encoder's inputs from a tokenizer.json dict, or Unsupported."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise Unsupported(f"model {model.get('type')!r} (only BPE)")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise Unsupported(f"BPE {key}={model.get(key)!r}")
    norm = spec.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        raise Unsupported(f"normalizer {norm.get('type')!r}")
    pt = spec.get("pre_tokenizer") or {}
    if _byte_level(pt) and pt.get("use_regex", True):
        mode = _PATTERNS[GPT2_PATTERN]
    elif (pt.get("type") == "Sequence" and len(pt.get("pretokenizers", [])) == 2
          and pt["pretokenizers"][0].get("type") == "Split" and _byte_level(pt["pretokenizers"][1])
          and not pt["pretokenizers"][1].get("use_regex", True)):
        split = pt["pretokenizers"][0]
        pattern = (split.get("pattern") or {}).get("Regex")
        if pattern not in _PATTERNS or split.get("behavior") != "Isolated" or split.get("invert"):
            raise Unsupported(f"Split pre-tokenizer {pattern!r} ({split.get('behavior')}, invert="
                              f"{split.get('invert')})")
        mode = _PATTERNS[pattern]
    else:
        raise Unsupported(f"pre-tokenizer {json.dumps(pt)[:200]}")
    if not _post_processor_ok(spec.get("post_processor")):
        raise Unsupported(f"post-processor {json.dumps(spec.get('post_processor'))[:200]}")
    inv = {c: b for b, c in _bytes_to_unicode().items()}
    vocab: dict[str, int] = model.get("vocab") or {}
    ids, blobs = [], []
    for tok, i in vocab.items():
        try:
            blobs.append(bytes(inv[c] for c in tok))
        except KeyError:
            raise Unsupported(f"vocabulary token {tok!r} is not in the byte-level alphabet") from None
        ids.append(i)
    by_bytes = dict(zip(blobs, ids))
    byte_ids = [by_bytes.get(bytes([b])) for b in range(256)]
    if None in byte_ids:
        raise Unsupported(f"byte {byte_ids.index(None)} has no token (not a byte-level vocabulary)")
    merges = []
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise Unsupported(f"merge {a!r} + {b!r} names a token not in the vocabulary")
        merges.append((vocab[a], vocab[b], vocab[a + b]))
    special = []
    for t in spec.get("added_tokens") or []:
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            raise Unsupported(f"added token {t['content']!r} has lstrip/rstrip/single_word")
        if t["content"]:
            special.append((t["content"].encode(), int(t["id"]), int(bool(t.get("normalized")))))
    special.sort(key=lambda s: -len(s[0]))  # longest first: leftmost-longest matching
    return {"mode": mode, "ignore_merges": bool(model.get("ignore_merges")), "nfc": norm is not None,
            "ids": ids, "blobs": blobs, "byte_ids": byte_ids, "merges": merges, "special": special}


def _lib():
    lib = load_library("bpe.cpp")
    if lib is not None and not getattr(lib, "_ftlib_typed", False):
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        lib.ftlib_bpe_new.restype = p
        lib.ftlib_bpe_new.argtypes = [i32, i32, i32, p, i64, i64, p, p, p, i64, p, p, i64, p, p, p, p]
        lib.ftlib_bpe_free.argtypes = [p]
        lib.ftlib_bpe_encode.restype = i64
        lib.ftlib_bpe_encode.argtypes = [p, p, p, i64, p, p, p, i64]
        lib._ftlib_typed = True
    return lib


def _blob(parts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    off = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(b) for b in parts], out=off[1:])
    return np.frombuffer(b"".join(parts) or b"\0", np.uint8), off


class FastBPE:
    """C++ byte-level BPE with the ids and offsets of the tokenizer it was built from (module doc)."""

    def __init__(self, spec: dict):
        p = _parse(spec)
        lib = _lib()
        if lib is None:
            raise Unsupported("csrc/bpe.cpp could not be built (no C++ compiler found; set CXX)")
        self._lib, self.nfc = lib, p["nfc"]
        self._lock = threading.Lock()  # ctypes drops the GIL; the encoder's cache and scratch are not shared-safe
        cls = _unicode_classes()
        vb, vo = _blob(p["blobs"])
        sb, so = _blob([s for s, _, _ in p["special"]])
        vid = np.asarray(p["ids"], np.int32)
        mer = np.asarray(p["merges"], np.int32).reshape(-1, 3)
        bid = np.asarray(p["byte_ids"], np.int32)
        sid = np.asarray([i for _, i, _ in p["special"]], np.int32)
        snorm = np.asarray([k for _, _, k in p["special"]], np.int32)
        mode, digits = p["mode"]
        self._h = lib.ftlib_bpe_new(mode, digits, int(p["ignore_merges"]), cls.ctypes.data, len(cls), len(vid),
                                    vid.ctypes.data, vb.ctypes.data, vo.ctypes.data, len(mer), mer.ctypes.data,
                                    bid.ctypes.data, len(sid), sid.ctypes.data, sb.ctypes.data, so.ctypes.data,
                                    snorm.ctypes.data)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> FastBPE:
        """From a ``tokenizers.Tokenizer`` (or a ``transformers`` fast tokenizer's ``backend_tokenizer``)."""
        tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
        return cls(json.loads(tok.to_str()))

    def __del__(self):
        h, self._h = getattr(self, "_h", None), None
        if h:
            self._lib.ftlib_bpe_free(h)

    def __getstate__(self):
        raise TypeError("FastBPE holds a C++ encoder: build one per process (FastBPE.from_tokenizer)")

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``(ids int32 (T,), offsets int64 (T, 2), counts int64 (len(texts),))``: the texts' tokens end to end,
        character offsets within each text; None when a text is not already NFC under an NFC normalizer
        (or cannot be UTF-8 encoded), for the caller to use ``tokenizers``."""
        if self.nfc and not all(unicodedata.is_normalized("NFC", t) for t in texts):
            return None
        try:
            parts = [t.encode("utf-8") for t in texts]
        except UnicodeEncodeError:  # lone surrogates
            return None
        text, off = _blob(parts)
        cap = max(int(off[-1]), 1)
        ids = np.empty(cap, np.int32)
        offs = np.empty((cap, 2), np.int64)
        counts = np.empty(len(texts), np.int64)
        with self._lock:
            n = self._lib.ftlib_bpe_encode(self._h, text.ctypes.data, off.ctypes.data, len(texts), ids.ctypes.data,
                                           offs.ctypes.data, counts.ctypes.data, cap)
        if n < 0:
            raise RuntimeError("ftlib_bpe_encode: output capacity exceeded")
        return ids[:n], offs[:n], counts


def fast_bpe_for(tokenizer, backend: str | None = None) -> FastBPE | None:
    """``FastBPE.from_tokenizer(tokenizer)``, or None when it does not reproduce that tokenizer exactly.

    ``backend`` (default ``$FTLIB_BPE_BACKEND``, else ``auto``): ``auto`` as above, ``tokenizers`` always
    None, ``cpp`` raises ``Unsupported`` (naming the part) instead of returning None."""
    backend = backend or os.environ.get("FTLIB_BPE_BACKEND", "auto")
    if backend not in ("auto", "cpp", "tokenizers"):
        raise ValueError(f"FTLIB_BPE_BACKEND must be auto|cpp|tokenizers, got {backend!r}")
    if backend == "tokenizers":
        return None
    try:
        return FastBPE.from_tokenizer(tokenizer)
    except Unsupported:
        if backend == "cpp":
            raise
        return None
