"""The documentation site: ``mkdocs build --strict`` (warnings are errors, broken links and
cross-references included) succeeds, the API reference has a page for every public module of ftlib
with every name of its ``__all__``, the guides are all reachable from the home page and from the
README, the backend table is the code's, and the imports, commands and flags the pages show exist.

The expected names are read from the source here (``ast``), not from the docs hook, so a module or a
name the reference drops fails a test. The tests of the built site need the ``docs`` extra (in
``dev``: CI installs it) and skip, saying so, without it; the others read only the Markdown.
"""

from __future__ import annotations

import ast
import html
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _missing(modules: tuple[str, ...]) -> list[str]:
    out = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            out.append(module)
    return out


MISSING = _missing(("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"))

GUIDES = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs" / "guides").glob("*.md"))


def _all(src: Path) -> list[str]:
    for node in ast.parse(src.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def _public_children(folder: Path) -> list[tuple[str, Path]]:
    """(name, source file) of the public modules and packages in a folder."""
    out = []
    for path in sorted(folder.iterdir()):
        src = path / "__init__.py" if path.is_dir() else path
        if not path.name.startswith("_") and src.suffix == ".py" and src.exists():
            out.append((path.stem, src))
    return out


def public_api() -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """{"ftlib.x": (its __all__, {"ftlib.x.sub": the sub's __all__} for each public submodule)} for every
    public top-level module and package of ftlib."""
    api = {}
    for name, src in _public_children(ROOT / "ftlib"):
        subs = ({f"ftlib.{name}.{sub}": _all(s) for sub, s in _public_children(src.parent)}
                if src.name == "__init__.py" else {})
        api[f"ftlib.{name}"] = (_all(src), subs)
    return api


def has_entry(source: str, module: str, name: str) -> bool:
    """An entry's anchor is its dotted path: ftlib.data.TokenLoader, or (a function exported under the
    name of its own submodule) ftlib.kernels.attention.attention."""
    return (f'id="{module}.{name}"' in source
            or re.search(rf'id="{re.escape(module)}\.[\w.]+\.{re.escape(name)}"', source) is not None)


def text_of(page: Path) -> str:
    """The visible text of an HTML page's main part (not the navigation), whitespace collapsed."""
    main = page.read_text().split('role="main"', 1)[-1]
    body = re.sub(r"<script.*?</script>|<[^>]+>", " ", main, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(body))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site (the tests that read it skip, with the reason, without the docs extra)."""
    if MISSING:
        pytest.skip(f"the docs extra is not installed (missing {', '.join(MISSING)}): pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return out


def test_every_public_name_has_its_entry(site):
    api = public_api()
    assert {"ftlib.data", "ftlib.lora", "ftlib.models", "ftlib.train"} <= set(api)
    assert "ftlib.data.packing" in api["ftlib.data"][1]
    missing = {}
    for module, (names, subs) in api.items():
        page = site / "reference" / module.removeprefix("ftlib.") / "index.html"
        assert page.exists(), f"no reference page for {module}"
        source = page.read_text()
        if gone := [n for n in names if not has_entry(source, module, n)]:
            missing[module] = gone
        for sub, sub_names in subs.items():
            sub_page = site / "reference" / Path(*sub.split(".")[1:]) / "index.html"
            assert sub_page.exists(), f"no reference page for {sub}"
            sub_source = sub_page.read_text()
            assert f'id="{sub}"' in sub_source, f"{sub}: its page does not open with the module"
            # a name the package re-exports is documented on the package's page, the others here
            if gone := [n for n in sub_names if not (has_entry(sub_source, sub, n) or has_entry(source, module, n))]:
                missing[sub] = gone
    assert not missing, f"__all__ names without an entry in the reference: {missing}"


def test_data_page_documents_the_loader(site):
    text = text_of(site / "reference" / "data" / "index.html")
    cls = next(n for n in ast.parse((ROOT / "ftlib/data/loader.py").read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "TokenLoader")
    first_line = ast.get_docstring(cls).splitlines()[0]
    assert "TokenLoader" in text and re.sub(r"`+", "", first_line) in text, first_line
    # the module docstring opens the page
    assert "Data pipeline: sources -> formatting" in text


def test_home_page_links_every_guide(site):
    assert len(GUIDES) >= 8, GUIDES
    index = (site / "index.html").read_text()
    body = index.split('role="main"', 1)[-1]  # the page itself, not the navigation bar
    for guide in GUIDES:
        href = guide.removesuffix(".md") + "/"
        assert f'href="{href}"' in body, f"docs/index.md does not link {guide}"
        page = site / href / "index.html"
        words = len(text_of(page).split())
        assert words > 300, f"{guide}: only {words} words on its page"


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?:docs|examples|benchmarks)/[^)#\s]+)", readme)
    assert any(link.startswith("docs/guides/") for link in links), "the README links no guide"
    broken = [link for link in links if not (ROOT / link).exists()]
    assert not broken, f"README links to missing files: {broken}"
    linked = {link.removeprefix("docs/") for link in links}
    assert set(GUIDES) <= linked, f"guides the README does not link: {sorted(set(GUIDES) - linked)}"


BACKEND_VAR = re.compile(r"FTLIB_[A-Z0-9_]+_BACKEND")


def backend_switches() -> dict[str, tuple[str, ...] | None]:
    """{variable: its values, or None where the code does not list them in one literal} of every
    ``FTLIB_*_BACKEND`` switch ftlib reads: ``os.environ.get("FTLIB_X_BACKEND", ...)``,
    ``backend_choice("FTLIB_X_BACKEND")``, or a key of a literal ``BACKENDS = {variable: values}``."""
    found: dict[str, tuple[str, ...] | None] = {}
    for path in sorted((ROOT / "ftlib").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                reads_env = name == "get" and "environ" in ast.unparse(func)
                if (reads_env or name == "backend_choice") and BACKEND_VAR.fullmatch(str(node.args[0].value)):
                    found.setdefault(node.args[0].value, None)
            if (isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Dict)
                    and "BACKENDS" in ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)):
                for var, values in ast.literal_eval(node.value).items():
                    if BACKEND_VAR.fullmatch(var):
                        found[var] = tuple(values)
    return found


def test_backend_table_is_the_code_and_in_one_place():
    switches = backend_switches()
    assert "FTLIB_ATTN_BACKEND" in switches and "FTLIB_PACK_BACKEND" in switches, switches
    rows = {}
    for line in (ROOT / "docs/guides/kernels.md").read_text().splitlines():
        if m := re.match(r"\| `(FTLIB_\w+_BACKEND)` \| ([^|]*(?:\\\|[^|]*)*) \|", line):
            assert m.group(1) not in rows, f"docs/guides/kernels.md: two rows for {m.group(1)}"
            rows[m.group(1)] = tuple(re.findall(r"`([a-z0-9_]+)`", m.group(2)))
    assert set(rows) == set(switches), (
        f"docs/guides/kernels.md's table and the code differ: only in the table {sorted(set(rows) - set(switches))}, "
        f"only in the code {sorted(set(switches) - set(rows))}")
    for var, values in switches.items():
        assert rows[var][0] == "auto", f"{var}: the table's values should start with auto, got {rows[var]}"
        if values is not None:
            assert rows[var] == values, f"{var}: the table says {rows[var]}, the code {values}"
    # one table: no other page of the docs, nor the README, lists the switches as table rows
    others = [p for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")] if p.name != "kernels.md"]
    for page in others:
        assert not re.search(r"^\| `FTLIB_\w+_BACKEND`", page.read_text(), re.M), f"{page}: a second backend table"


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def _string_literals(paths) -> set[str]:
    out = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
    return out


def test_python_in_the_docs_imports_public_names():
    """Every ```python block parses, and each ``from ftlib.x import a, b`` names a public module and
    names in its ``__all__`` (read from the source: a rename that leaves a guide behind fails here)."""
    wrong = []
    for page in _pages():
        for block in _blocks(page.read_text(), "python"):
            tree = ast.parse(block)  # a SyntaxError names the block's line
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ftlib":
                    path = ROOT.joinpath(*node.module.split("."))
                    src = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
                    if not src.exists():
                        wrong.append(f"{page.name}: no module {node.module}")
                        continue
                    public = set(_all(src)) | {name for name, _ in _public_children(src.parent)
                                               if src.name == "__init__.py"}
                    wrong += [f"{page.name}: {node.module}.{a.name} is not in its __all__"
                              for a in node.names if a.name not in public]
    assert not wrong, "\n".join(wrong)


def test_commands_in_the_docs_exist():
    """Each ``ftlib <command>`` in a ```bash block is a command of ``ftlib.cli.COMMANDS``, and each
    ``--flag`` given to it, to an example or to a benchmark script is a flag that code defines."""
    cli = ast.parse((ROOT / "ftlib/cli/__init__.py").read_text())
    commands = next(ast.literal_eval(n.value) for n in ast.walk(cli)
                    if isinstance(n, ast.AnnAssign | ast.Assign) and "COMMANDS" in ast.unparse(n)
                    and isinstance(n.value, ast.Dict))
    sources = [*(ROOT / "ftlib").rglob("*.py"), *(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    defined = {s for s in _string_literals(sources) if s.startswith("--")}
    defined |= {"--no-" + s[2:] for s in defined}  # argparse.BooleanOptionalAction
    defined |= {"--help", "--version"}
    wrong = []
    for page in _pages():
        for block in _blocks(page.read_text(), "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("#", 1)[0]
                for m in re.finditer(r"(?:^|\s|-m )ftlib (\S+)((?:\s+[^\s|&;]+)*)", line):
                    if m.group(1) not in commands:
                        wrong.append(f"{page.name}: ftlib {m.group(1)}: no such command")
                for m in re.finditer(r"(?:(?:^|\s|-m )ftlib \S+|examples/\S+\.py|benchmarks/\S+\.py)((?:\s+[^\s|&;]+)*)", line):
                    wrong += [f"{page.name}: {flag} is defined nowhere in ftlib/, examples/, benchmarks/"
                              for flag in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", m.group(1))
                              if flag not in defined]
    assert not wrong, "\n".join(wrong)
