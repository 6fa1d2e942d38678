"""mkdocs hook: one API reference page per public module of ftlib, listing every ``__all__`` name.

The public modules are read from the tree (every ``ftlib/<name>.py`` and ``ftlib/<name>/`` whose
name has no leading underscore), so a module added, renamed or turned into a package shows up
without editing ``mkdocs.yml``. Each page is ``::: ftlib.<name>``: mkdocstrings renders the
module's docstring and the members its ``__all__`` exports (``filters: public``), re-exports
from submodules included.

One case is written out: a package exporting a name that is also one of its submodules
(``from .attention import attention`` in ``ftlib/kernels/__init__.py``). Python binds the
function; griffe, reading the source, keeps the submodule (griffe issue #124), so the page would
lose the function. Such a name gets its own ``::: <defining module>.<name>`` block on the page
(link it by that path: ``[attention][ftlib.kernels.attention.attention]``; ``ftlib.kernels.attention``
is the submodule's page).

A package's public submodules (``ftlib/data/packing.py``, ...) get a page each under the package's:
the submodule's docstring (the math, the format, the reference) and the names of its ``__all__``
that the package does not export (those are documented once, on the package's page).
"""

from __future__ import annotations

import ast
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ftlib"


def public_modules() -> list[str]:
    """Dotted names of ftlib's public top-level modules and packages, sorted."""
    names = []
    for path in sorted(PACKAGE.iterdir()):
        name = path.stem if path.suffix == ".py" else path.name
        if name.startswith("_"):
            continue
        if (path.is_file() and path.suffix == ".py") or (path.is_dir() and (path / "__init__.py").exists()):
            names.append(f"ftlib.{name}")
    return names


def source_of(module: str) -> Path:
    """The file of a dotted ftlib module name: ``ftlib/x.py`` or ``ftlib/x/__init__.py``."""
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def exported(module: str) -> list[str]:
    """The module's ``__all__`` (a literal list: tests/test_layering.py holds every module to it)."""
    for node in ast.parse(source_of(module).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def shadowed(module: str) -> list[str]:
    """``<defining module>.<name>`` of each ``__all__`` name that is also a submodule's name."""
    path = ROOT.joinpath(*module.split("."))
    if not path.is_dir():
        return []
    origin = {}
    for node in ast.parse(source_of(module).read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                origin[alias.asname or alias.name] = f"{module}.{node.module}.{alias.name}"
    out = []
    for name in exported(module):
        if (path / f"{name}.py").exists() or (path / name / "__init__.py").exists():
            if name not in origin:
                raise ValueError(f"{source_of(module)}: __all__ name {name!r} is a submodule, not a "
                                 "name imported with 'from .x import name'; the reference cannot show it")
            out.append(origin[name])
    return out


def submodules(package: str) -> list[str]:
    """Dotted names of a package's public submodules and subpackages (none for a module), sorted."""
    path = ROOT.joinpath(*package.split("."))
    if not path.is_dir():
        return []
    out = []
    for child in sorted(path.iterdir()):
        name = child.stem if child.suffix == ".py" else child.name
        if name.startswith("_"):
            continue
        if (child.is_file() and child.suffix == ".py") or (child.is_dir() and (child / "__init__.py").exists()):
            out.append(f"{package}.{name}")
    return out


def page_path(module: str) -> str:
    """``reference/data.md`` for ``ftlib.data``, ``reference/data/packing.md`` for ``ftlib.data.packing``."""
    return "reference/" + "/".join(module.split(".")[1:]) + ".md"


def subpage(module: str, package: str) -> str:
    """The page of a submodule: its docstring and the ``__all__`` names the package does not export."""
    own = [n for n in exported(module) if n not in set(exported(package))]
    members = "[" + ", ".join(own) + "]" if own else "false"
    return f"::: {module}\n    options:\n      members: {members}\n"


def page(module: str) -> str:
    """The Markdown of one reference page."""
    text = f"::: {module}\n"
    for target in shadowed(module):
        text += f"\n::: {target}\n    options:\n      heading_level: 2\n      show_root_full_path: false\n"
    return text


def on_config(config):
    """Append the Reference section to the nav: ftlib (the package), then each public module."""
    pages: list = [{"ftlib": "reference/index.md"}]
    for m in public_modules():
        subs = submodules(m)
        pages.append({m: [{m: page_path(m)}] + [{s: page_path(s)} for s in subs]} if subs else {m: page_path(m)})
    config.nav.append({"Reference": pages})
    return config


def on_files(files, config):
    """Add the generated reference pages to the site's files."""
    modules = public_modules()
    index = ["# API reference", "",
             "Generated from the docstrings: one page per public module or package, with every name in",
             "its `__all__` (import them from there), and under a package one page per submodule: its",
             "docstring (the math, the format, the reference) and the names only it exports.", "",
             "| module | what it holds |", "|---|---|"]
    for m in modules:
        tree = ast.parse(source_of(m).read_text())
        doc = (ast.get_docstring(tree) or "").split("\n\n")[0].replace("\n", " ").replace("|", "\\|")
        index.append(f"| [`{m}`]({page_path(m).removeprefix('reference/')}) | {doc} |")
    index += ["", "::: ftlib", "    options:", "      show_root_heading: false"]
    files.append(File.generated(config, "reference/index.md", content="\n".join(index) + "\n"))
    for module in modules:
        files.append(File.generated(config, page_path(module), content=page(module)))
        for sub in submodules(module):
            files.append(File.generated(config, page_path(sub), content=subpage(sub, module)))
    return files
