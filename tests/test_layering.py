"""The import graph of ``ftlib/``, read with ``ast`` (nothing is imported): no cycles, no arrow up.

Layers, bottom to top. A module imports only from its own layer or below, never up:

    0  leaf helpers  ftlib._atomic ftlib._backends ftlib._cbuild ftlib._dist ftlib._fields ftlib._jinja
    1  cpu           ftlib.cpu            (the C++ CPU compute kernels and their loader; called only by
                                           the op families of kernels, never by the model or adapters)
    2  kernels       ftlib.kernels        (attention, LoRA matmul, token augmentation; NF4/DoRA math)
    3  models        ftlib.models         (the model is adapter-agnostic: apply_lora swaps its layers
                                           from outside, so models never import lora)
    4  lora          ftlib.lora           (adapters over any nn.Module; the kernels compute them)
    5  data          ftlib.data           (text -> token batches; takes a tokenizer, builds no model)
    6  augment       ftlib.augment        (acts on the token batches of data, via the kernels)
    7  training      ftlib.optim ftlib.clip ftlib.sched ftlib.losses ftlib.offload
                     ftlib.embed_noise ftlib.nan_trace ftlib.long_context
    8  objectives    ftlib.preference ftlib.onpolicy ftlib.rl ftlib.evaluation ftlib.metrics
    9  checkpoint    ftlib.checkpoint     (saves the state of everything below)
   10  distributed   ftlib.distributed    (shards models, sharded checkpoints on checkpoint's format)
   11  train         ftlib.train          (what a training script shares: step plan, resume of a whole
                                           train state, run manifest, merged export)
   12  cli           ftlib.cli ftlib.__main__  (the installed ``ftlib`` command: the full jobs)
       top           ftlib                (the package ``__init__``: imports nothing)

Checked on every module of ``ftlib/``, imports inside functions included (they run later, but an
arrow up or a circle through them is still a dependency the wrong way):

- (a) no import cycle between modules (strongly connected components of the module graph; an
  import of a package counts as an arrow to its ``__init__``, an import of a submodule to it);
- (b) no import of a higher layer;
- (c) no private name (``_x``) imported from, or read off, another module. A private module
  (``_x.py``) is visible inside the package that holds it, subpackages included: its names, private
  or not, may be imported there (``ftlib._atomic`` anywhere in ftlib, ``ftlib.kernels._lora_kernels``
  in ``ftlib.kernels``), never from outside;
- (d) every ``__all__`` is a literal list of strings in sorted order (``sorted()``, so upper-case
  constants and classes come before functions).

``KNOWN_VIOLATIONS`` lists what the tree still does wrong, each with the area that fixes it; the
list only shrinks. A violation not in it fails ``test_import_graph``; an entry that no longer
occurs fails ``test_known_violations_still_occur`` (delete the entry).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaf helpers", ("ftlib._atomic", "ftlib._backends", "ftlib._cbuild", "ftlib._dist", "ftlib._fields",
                      "ftlib._jinja")),
    ("cpu", ("ftlib.cpu",)),
    ("kernels", ("ftlib.kernels",)),
    ("models", ("ftlib.models",)),
    ("lora", ("ftlib.lora",)),
    ("data", ("ftlib.data",)),
    ("augment", ("ftlib.augment",)),
    ("training", ("ftlib.optim", "ftlib.clip", "ftlib.sched", "ftlib.losses", "ftlib.offload",
                  "ftlib.embed_noise", "ftlib.nan_trace", "ftlib.long_context")),
    ("objectives", ("ftlib.preference", "ftlib.onpolicy", "ftlib.rl", "ftlib.evaluation", "ftlib.metrics")),
    ("checkpoint", ("ftlib.checkpoint",)),
    ("distributed", ("ftlib.distributed",)),
    ("train", ("ftlib.train",)),
    ("cli", ("ftlib.cli", "ftlib.__main__")),
]

# (violation, area that fixes it). Strings as ``violations()`` writes them. When this test was
# written the tree had 2 cycles, 4 upward imports (all inside functions), 35 private imports and
# 23 unsorted __all__; all are fixed. The list only shrinks: keep it empty.
KNOWN_VIOLATIONS: list[tuple[str, str]] = []


# ----------------------------------------------------------------------------------------------
# Reading the tree
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Import:
    src: str  # importing module
    dst: str  # imported module (a submodule, or the module/package a name comes from)
    name: str | None  # the name taken from dst (``from dst import name``), else None
    line: int
    lazy: bool  # inside a function body


def find_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root/ftlib`` (packages by ``__init__``)."""
    out = {}
    for p in sorted((root / "ftlib").rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _known_prefix(name: str, modules) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def read_imports(module: str, path: Path, modules) -> tuple[list[Import], list[tuple[str, str, int]]]:
    """The ftlib imports of one module, and its reads ``m._x`` of private attributes of ftlib
    modules bound by an import (as (module, attribute, line))."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    imports: list[Import] = []
    bound: dict[str, str] = {}  # local name -> ftlib module it is bound to

    def visit(node, lazy):
        for ch in ast.iter_child_nodes(node):
            inner = lazy or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(ch, ast.Import):
                for a in ch.names:
                    dst = _known_prefix(a.name, modules)
                    if dst is not None:
                        imports.append(Import(module, dst, None, ch.lineno, inner))
                        if a.asname:
                            bound[a.asname] = dst
            elif isinstance(ch, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (ch.level - 1)] if ch.level else []
                full = ".".join(base + ([ch.module] if ch.module else []))
                if full == "ftlib" or full.startswith("ftlib."):
                    for a in ch.names:
                        if f"{full}.{a.name}" in modules:  # a submodule
                            imports.append(Import(module, f"{full}.{a.name}", None, ch.lineno, inner))
                            bound[a.asname or a.name] = f"{full}.{a.name}"
                        else:
                            dst = full if full in modules else _known_prefix(full, modules)
                            imports.append(Import(module, dst, a.name, ch.lineno, inner))
            visit(ch, inner)

    visit(tree, False)
    reads = sorted({(bound[n.value.id], n.attr, n.lineno) for n in ast.walk(tree)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in bound
                    and _private(n.attr)})
    return imports, reads


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def layer_of(module: str) -> int | None:
    """Index into ``LAYERS`` (None for the top package ``ftlib`` itself)."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def _visible(private_module: str, importer: str) -> bool:
    """Whether ``importer`` may use ``private_module`` (a module with a ``_x`` part): it lies inside
    the package that holds the first private part."""
    parts = private_module.split(".")
    first = next(i for i, p in enumerate(parts) if _private(p))
    holder = ".".join(parts[:first])
    return importer == holder or importer.startswith(holder + ".")


def _is_private_module(module: str) -> bool:
    return any(_private(p) for p in module.split("."))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v):  # Tarjan; the graph has a few hundred nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(out)


def violations(root: Path = ROOT) -> dict[str, list[str]]:
    """Every violation (the key ``KNOWN_VIOLATIONS`` uses) -> where it occurs (file:line)."""
    modules = find_modules(root)
    found: dict[str, list[str]] = {}

    def add(key, where):
        found.setdefault(key, []).append(where)

    edges: dict[str, set[str]] = {}
    for mod, path in modules.items():
        rel = path.relative_to(root)
        imports, reads = read_imports(mod, path, modules)
        for imp in imports:
            if imp.dst is None:
                add(f"unknown module: {mod} imports a module ftlib does not have", f"{rel}:{imp.line}")
                continue
            where = f"{rel}:{imp.line}" + (" (inside a function)" if imp.lazy else "")
            if imp.dst != mod:
                edges.setdefault(mod, set()).add(imp.dst)
            lo, hi = layer_of(mod), layer_of(imp.dst)
            if hi is not None and (lo is None and mod != "ftlib" or lo is not None and hi > lo):
                add(f"upward: {mod} ({LAYERS[lo][0] if lo is not None else '?'}) -> {imp.dst} "
                    f"({LAYERS[hi][0]})", where)
            if _is_private_module(imp.dst) and not _visible(imp.dst, mod):
                add(f"private: {mod} imports the private module {imp.dst}", where)
            elif (imp.name is not None and _private(imp.name) and imp.dst != mod
                  and not (_is_private_module(imp.dst) and _visible(imp.dst, mod))):
                add(f"private: {mod} imports {imp.name} from {imp.dst}", where)
        for dst, attr, line in reads:
            if dst != mod and not (_is_private_module(dst) and _visible(dst, mod)):
                add(f"private: {mod} reads {dst}.{attr}", f"{rel}:{line}")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if (isinstance(node, (ast.Assign, ast.AnnAssign))
                    and any(isinstance(t, ast.Name) and t.id == "__all__"
                            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))):
                try:
                    names = ast.literal_eval(node.value)
                except ValueError:
                    add(f"__all__ not a literal: {mod}", f"{rel}:{node.lineno}")
                    continue
                if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
                    add(f"__all__ not a list of strings: {mod}", f"{rel}:{node.lineno}")
                elif list(names) != sorted(names):
                    add(f"unsorted __all__: {mod}", f"{rel}:{node.lineno}")
    for comp in cycles(edges):
        add("cycle: " + " <-> ".join(comp), ", ".join(str(modules[m].relative_to(root)) for m in comp))
    return found


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------

def _kind(key: str) -> str:
    return key.split(":")[0]


@functools.cache
def _found_in_tree() -> dict[str, list[str]]:
    return violations()


def test_import_graph():
    found = _found_in_tree()
    known = {k for k, _ in KNOWN_VIOLATIONS}
    new = {k: v for k, v in found.items() if k not in known}
    assert not new, "import-graph violations (see this file's docstring for the rules):\n" + "\n".join(
        f"  {k}\n      at {', '.join(v)}" for k, v in sorted(new.items()))


def test_known_violations_still_occur():
    found = _found_in_tree()
    stale = [k for k, _ in KNOWN_VIOLATIONS if k not in found]
    assert not stale, "fixed; delete from KNOWN_VIOLATIONS:\n" + "\n".join(f"  {k}" for k in stale)
    keys = [k for k, _ in KNOWN_VIOLATIONS]
    assert len(keys) == len(set(keys)), "KNOWN_VIOLATIONS lists an entry twice"


def test_every_module_has_a_layer():
    assert [m for m in find_modules() if m != "ftlib" and layer_of(m) is None] == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_the_checks_catch_each_kind(tmp_path):
    """A small tree with one violation of each kind (and allowed imports beside them)."""
    root = _tree(tmp_path, {
        "ftlib/__init__.py": "",
        "ftlib/_atomic.py": "def _helper(): pass\n",
        "ftlib/kernels/__init__.py": "from .ops import op\n__all__ = ['op']\n",
        "ftlib/kernels/_k.py": "def _kernel(): pass\n",
        "ftlib/kernels/ops.py": ("from ftlib._atomic import _helper\nfrom ._k import _kernel\n"
                                 "from . import util\n__all__ = ['op', 'Z']\ndef op():\n"
                                 "    from ftlib.models import rope\n    return util._secret\n"),
        "ftlib/kernels/util.py": "from .ops import op\n_secret = 1\n",
        "ftlib/models/__init__.py": "",
        "ftlib/models/rope.py": "",
        "ftlib/models/llama.py": "from ftlib.kernels.ops import op\nfrom ftlib.kernels._k import _kernel\n"
                                 "from ftlib.kernels.util import _secret\n",
    })
    assert sorted(violations(root)) == [
        "cycle: ftlib.kernels.ops <-> ftlib.kernels.util",
        "private: ftlib.kernels.ops reads ftlib.kernels.util._secret",
        "private: ftlib.models.llama imports _secret from ftlib.kernels.util",
        "private: ftlib.models.llama imports the private module ftlib.kernels._k",
        "unsorted __all__: ftlib.kernels.ops",
        "upward: ftlib.kernels.ops (kernels) -> ftlib.models.rope (models)",
    ]
    v = violations(root)
    assert v["upward: ftlib.kernels.ops (kernels) -> ftlib.models.rope (models)"] == [
        "ftlib/kernels/ops.py:6 (inside a function)"]

