"""Shards: the data files a source spec names (paths, directories, globs, hub dataset repos) and
their fingerprints.

A *shard* is one file on disk; the token cache tokenizes and stores each shard separately, so
adding shards to a corpus only tokenizes the new ones. ``list_shards(spec)`` expands a path, a
directory (recursively, sorted), a glob, or ``hf://datasets/owner/name[@revision][/path or glob]``
into shards, each of a kind given by its file name (:func:`shard_kind`); ``ftlib.data.readers``
reads them.

Formats (by file name; ``.gz`` after any of the first three means gzip)
    ``*.jsonl``     one JSON object per line (blank lines are skipped)
    ``*.json``      a JSON array of objects, one object, or a sequence of objects (JSON Lines
                    named ``.json``); parsed in the reader, each object located by its line
    ``*.txt``       the whole file is one document: ``{"text": ...}``
    ``*.parquet``   one record per row (read in row groups with pyarrow)
    ``*.tar``, ``*.tar.gz``, ``*.tgz``  streamed with ``tarfile`` mode ``r|*`` (never extracted
                    to disk). Members of the formats above are read as files. Members ``.json``
                    / ``.txt`` are grouped into *webdataset samples*: adjacent members sharing a
                    key (the member path up to the first dot of its base name, e.g.
                    ``shard/000017`` for ``shard/000017.json`` and ``shard/000017.txt``). A key
                    with one member is read as that file; a key with several becomes one record:
                    the fields of its ``.json`` object(s) plus, per text member, a field named by
                    its extension (``txt`` -> ``"text"``, ``en.txt`` -> ``"en.txt"``). Parquet
                    members are read into memory (Parquet needs random access).
                    Refused (reported, never read as data): links, members with an absolute path
                    or a ``..`` component, non-regular members, members of any other type.

Directories hold data files of the types above; other files in them (README.md, ...) are listed
in a warning, hidden files and directories are not looked at.

Links. Directory walks and ``**`` globs follow symbolic links but visit each real path once: a
link to a directory already read, or to one that contains the directory being read (``self ->
.``, ``up -> ..``: a loop), and a link to a file listed under its own path are not followed, and
one warning names each of them (nothing is lost: their content is read once, through its other
path). Several links to one file that is not itself listed are all read (the hub cache links
files with equal bytes to one blob). A link whose target does not exist is an error naming both.

Fingerprint. :func:`shard_fingerprint` is the shard's size plus a SHA-256 over its first and
last MiB and 16 evenly spaced 64 KiB blocks. It costs ~3 MiB of reads per shard whatever the
shard size (a full hash of a 100 GB corpus would take minutes at every cache check), and it
ignores mtime on purpose, so a copied or re-downloaded identical file still hits the cache.
An edit that keeps the size and touches none of the sampled blocks is missed: pass
``full_hash=True`` (SHA-256 of every byte) when that matters.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote

from .report import DataError

__all__ = [
    "KIND_EXTS",
    "SUPPORTED_EXTS",
    "Shard",
    "list_shards",
    "parse_hub_spec",
    "resolve_hub_dataset",
    "shard_fingerprint",
    "shard_kind",
]

# kind -> file name endings (matched case-insensitively, longest first where they overlap)
KIND_EXTS = {
    "jsonl": (".jsonl", ".jsonl.gz"),
    "json": (".json", ".json.gz"),
    "text": (".txt", ".txt.gz"),
    "parquet": (".parquet",),
    "tar": (".tar", ".tar.gz", ".tgz"),
}
SUPPORTED_EXTS = tuple(e for exts in KIND_EXTS.values() for e in exts)



@dataclass(frozen=True)
class Shard:
    """One source file; ``kind`` is ``jsonl`` | ``json`` | ``text`` | ``parquet`` | ``tar``."""

    path: str
    kind: str



def shard_kind(path: str) -> str | None:
    """The kind of a data file by its name (``jsonl``, ``json``, ``text``, ``parquet``, ``tar``), or None."""
    p = path.lower()
    for kind, exts in KIND_EXTS.items():
        if p.endswith(exts):
            return kind
    return None


# ---- hub ----------------------------------------------------------------------------------------
# Revisions that contain '/' (the Hub's own refs). Any other revision ends at the first '/', unless
# written URL-quoted (``@my%2Fbranch``), as the Hub's own hf:// paths do.
_SPECIAL_REF = re.compile(r"(refs/convert/\w+|refs/pr/\d+)(?=/|$)")


def parse_hub_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``hf://datasets/owner/name[@revision][/path]`` -> ``(repo_id, revision, path)``.

    ``revision`` may be a branch, tag or commit, one of the Hub's refs with slashes
    (``refs/convert/parquet``, ``refs/pr/3``), or URL-quoted (``feature%2Fx``).
    """
    prefix = "hf://datasets/"
    if not spec.startswith(prefix):
        raise DataError(f"{spec}: a hub dataset is written hf://datasets/owner/name[@revision][/path]")
    owner, _, rest = spec[len(prefix) :].partition("/")
    first = rest.split("/", 1)[0]
    rev = None
    if "@" in first:
        name, _, after = rest.partition("@")
        m = _SPECIAL_REF.match(after)
        if m:
            rev, sub = m.group(1), after[m.end() :].lstrip("/")
        else:
            rev, _, sub = after.partition("/")
            rev = unquote(rev)
        if not rev:
            raise DataError(f"{spec}: empty revision after '@'")
    else:
        name, _, sub = rest.partition("/")
    if not owner or not name:
        raise DataError(f"{spec}: a hub dataset is written hf://datasets/owner/name[@revision][/path]")
    return f"{owner}/{name}", rev, (sub.strip("/") or None)


def resolve_hub_dataset(repo_id: str, revision: str | None = None, cache_dir: str | None = None,
                        path: str | None = None) -> str:
    """Download (or find in the local hub cache) a dataset repo; return its local directory.

    Only data files are fetched (``allow_patterns`` on the supported extensions, under ``path``
    when given: a file, directory or glob inside the repo); no code that comes with the dataset
    is ever run.
    """
    from huggingface_hub import snapshot_download

    if path and shard_kind(path) is not None:  # a file or a glob of files: fetch exactly those
        patterns = [path]
    else:
        prefix = f"{path.rstrip('/')}/" if path else ""
        patterns = [f"{prefix}*{e}" for e in SUPPORTED_EXTS]
    return snapshot_download(
        repo_id=repo_id, repo_type="dataset", revision=revision, cache_dir=cache_dir, allow_patterns=patterns
    )


# ---- listing ------------------------------------------------------------------------------------
class _Walk:
    """Directories under one root, each real directory once; links not followed are collected."""

    def __init__(self, root: str):
        self.root, self.real_root = root, os.path.realpath(root)
        self.seen: set[str] = set()
        self.skipped: list[str] = []  # "link -> target (why)"

    def _follow(self, path: str) -> bool:
        real = os.path.realpath(path)
        why = None
        if real in self.seen:
            why = "a directory read already"
        elif os.path.islink(path) and self.real_root.startswith(real.rstrip(os.sep) + os.sep):
            why = f"a directory that contains {self.root}: a loop"
        if why is None:
            self.seen.add(real)
            return True
        self.skipped.append(f"{os.path.relpath(path, self.root)} -> {os.readlink(path) if os.path.islink(path) else real} "
                            f"({why})")
        return False

    def dirs(self, top: str | None = None) -> Iterator[str]:
        """``top`` (default: the root) and every directory below it, depth first, names sorted."""
        top = self.root if top is None else top
        if not self._follow(top):
            return
        yield top
        try:
            names = sorted(os.listdir(top))
        except OSError as e:
            raise DataError(f"{top}: cannot list the directory ({e})") from None
        for n in names:
            p = os.path.join(top, n)
            if not n.startswith(".") and os.path.isdir(p):
                yield from self.dirs(p)


def _files(d: str) -> list[str]:
    """Non-hidden entries of ``d`` that are not directories (files and links to files), sorted."""
    return sorted(os.path.join(d, n) for n in os.listdir(d)
                  if not n.startswith(".") and not os.path.isdir(os.path.join(d, n)))


def _glob(pattern: str, walks: list[_Walk]) -> list[str]:
    """``glob.glob(pattern, recursive=True)`` whose ``**`` visits each real directory once."""
    if "**" not in pattern:
        return sorted(glob.glob(pattern))
    parts = pattern.split(os.sep)
    i = next(k for k, part in enumerate(parts) if glob.has_magic(part))
    base = os.sep.join(parts[:i]) or (os.sep if pattern.startswith(os.sep) else os.curdir)
    out: list[str] = []

    def expand(path: str, rest: list[str]) -> None:
        if not rest:
            out.append(path)
            return
        seg, rest = rest[0], rest[1:]
        if seg == "**":
            w = _Walk(path)
            walks.append(w)
            for d in w.dirs():
                expand(d, rest)
                if not rest:
                    out.extend(_files(d))
        elif glob.has_magic(seg):
            for n in sorted(os.listdir(path)) if os.path.isdir(path) else []:
                if fnmatch.fnmatchcase(n, seg) and (seg.startswith(".") or not n.startswith(".")):
                    expand(os.path.join(path, n), rest)
        elif os.path.lexists(os.path.join(path, seg)):
            expand(os.path.join(path, seg), rest)

    if os.path.isdir(base):
        expand(base, parts[i:])
    if base == os.curdir and not pattern.startswith(os.curdir):  # as glob does: no leading ./
        out = [os.path.relpath(f) for f in out]
    return sorted(dict.fromkeys(out))


def _once(files: list[str], spec: str, walks: list[_Walk]) -> list[str]:
    """``files`` less the links to files that are listed under their own path; one warning names
    every link not followed (with those of the walks); a dangling link is an error.

    Links to one file from outside the listing (the Hugging Face hub cache links each file of a
    snapshot to a content-addressed blob, so two files with the same bytes share a target) are
    all kept: each is a file of the dataset.
    """
    own = {os.path.realpath(f) for f in files if not os.path.islink(f)}
    out, skipped = [], [s for w in walks for s in w.skipped]
    for f in files:
        if os.path.islink(f) and not os.path.exists(f):
            raise DataError(f"{f}: symbolic link to {os.readlink(f)}, which does not exist")
        real = os.path.realpath(f)
        if os.path.islink(f) and real in own:
            skipped.append(f"{f} -> {os.readlink(f)} (the file {real}, listed already)")
        else:
            out.append(f)
    if skipped:
        shown = "; ".join(skipped[:5]) + ("; ..." if len(skipped) > 5 else "")
        warnings.warn(f"{spec}: {len(skipped)} link(s) not followed, each leads to data read once already "
                      f"through another path: {shown}", stacklevel=3)
    return out


def list_shards(spec: str | os.PathLike | list, hub_cache_dir: str | None = None) -> list[Shard]:
    """Expand a source spec into shards, in a stable sorted order.

    ``spec``: a file, a directory (searched recursively), a glob pattern,
    ``hf://datasets/owner/name[@revision][/path]`` (see :func:`parse_hub_spec`), or a list of
    these. Without a path the whole repo is read, every split together; a path (file, directory
    or glob inside the repo, e.g. ``data/train-*.parquet``) selects one, and only its files are
    downloaded. Links are followed, each real path read once (see the module docstring).
    """
    if isinstance(spec, (list, tuple)):
        out: list[Shard] = []
        for s in spec:
            out.extend(list_shards(s, hub_cache_dir))
        return out
    spec = os.fspath(spec)
    if spec.startswith("hf://datasets/"):
        repo_id, rev, sub = parse_hub_spec(spec)
        local = resolve_hub_dataset(repo_id, rev, hub_cache_dir, sub)
        spec = os.path.join(local, sub) if sub else local
    walks: list[_Walk] = []
    if os.path.isdir(spec):
        walks.append(_Walk(spec))
        files, ignored = [], []
        for d in walks[0].dirs():
            for f in _files(d):
                (files if shard_kind(f) else ignored).append(f)
        files = _once(sorted(files), spec, walks)
        if not files:
            raise DataError(f"{spec}: directory holds no supported files ({', '.join(SUPPORTED_EXTS)})")
        if ignored:
            ignored.sort()
            shown = ", ".join(os.path.relpath(f, spec) for f in ignored[:5]) + (", ..." if len(ignored) > 5 else "")
            warnings.warn(f"{spec}: {len(ignored)} file(s) that are not data files were not read: {shown} "
                          f"(data files: {', '.join(SUPPORTED_EXTS)})", stacklevel=2)
    elif os.path.isfile(spec):
        files = [spec]
    elif os.path.islink(spec):
        raise DataError(f"{spec}: symbolic link to {os.readlink(spec)}, which does not exist")
    else:
        files = _once(_glob(spec, walks), spec, walks)
        if not files:
            raise DataError(f"{spec}: no such file, directory or matching glob")
    shards = []
    for f in files:
        kind = shard_kind(f)
        if kind is None:
            raise DataError(f"{f}: unsupported file type (supported: {', '.join(SUPPORTED_EXTS)})")
        shards.append(Shard(os.path.abspath(f), kind))
    return shards


def shard_fingerprint(path: str, full_hash: bool = False) -> str:
    """Content fingerprint of a file (see the module docstring for what it covers and why)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"{size}:".encode())
    with open(path, "rb") as f:
        if full_hash or size <= 3 << 20:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return f"sha256:{h.hexdigest()}"
        h.update(f.read(1 << 20))
        for i in range(16):
            f.seek((size - (64 << 10)) * (i + 1) // 17)
            h.update(f.read(64 << 10))
        f.seek(size - (1 << 20))
        h.update(f.read(1 << 20))
    return f"sampled-sha256:{h.hexdigest()}"
