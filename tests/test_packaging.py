"""The wheel's explicit package list stays in step with the source tree, and imports stay lazy."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_and_csrc_ship_in_the_wheel():
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ftlib").rglob("__init__.py")}
    assert on_disk | {"ftlib._csrc"} == set(cfg["packages"])
    assert cfg["package-dir"]["ftlib._csrc"] == "csrc"
    assert (ROOT / "csrc" / "bfd_pack.cpp").is_file()


def test_the_cpu_wings_sources_ship_in_the_wheel():
    """Every C++ file of ``ftlib/cpu/csrc`` matches the package data of ``ftlib.cpu``, and every kernel the
    loader declares has its source there (a wheel without them would run the PyTorch path only)."""
    tomllib = pytest.importorskip("tomllib")
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["ftlib.cpu"]
    pkg = ROOT / "ftlib" / "cpu"
    shipped = {p for g in globs for p in pkg.glob(g)}
    on_disk = {p for p in (pkg / "csrc").iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk and on_disk <= shipped
    from ftlib.cpu._library import SIGNATURES, source

    assert {Path(source(name)) for name in SIGNATURES} <= on_disk
    assert not list((ROOT / "csrc").glob("*.h")), "compute kernels belong in ftlib/cpu/csrc, csrc/ is the data path's"


def test_import_ftlib_pulls_in_no_optional_dependency():
    code = ("import sys, ftlib, ftlib.models, ftlib.data, ftlib.lora, ftlib.optim, ftlib.clip, ftlib.sched, "
            "ftlib.losses, ftlib.kernels, ftlib.preference, ftlib.data.pairs, ftlib.data.pair_batches; "
            "bad = [m for m in ('triton', 'flash_attn', 'bitsandbytes', 'transformers', 'peft', 'datasets') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_docstrings_point_to_files_that_ship():
    """DESIGN.md is not part of the package or the repository's examples: no module may send a reader there."""
    import ftlib

    pkg = os.path.dirname(ftlib.__file__)
    roots = [pkg, os.path.join(os.path.dirname(pkg), "examples"), os.path.join(os.path.dirname(pkg), "benchmarks")]
    seen = 0
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for name in sorted(files):
                if name.endswith(".py"):
                    seen += 1
                    path = os.path.join(dirpath, name)
                    assert "DESIGN.md" not in open(path).read(), path
    assert seen > 20
