"""`import deg_hf`, the config module and the trainers' shared mixin stay free of torch, transformers,
PEFT and TRL: configuration code and `deg-hf --help` never pay for them."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

HEAVY = ("torch", "transformers", "peft", "trl", "accelerate", "datasets")
ROOT = pathlib.Path(__file__).resolve().parents[1] / "deg_hf"
LIGHT_MODULES = ["__init__.py", "config.py", "trainers/mixin.py", "memory/planner.py", "memory/coef.py", "memory/dims.py", "memory/static.py", "checkpoint/__init__.py",
                 "checkpoint/redact.py", "checkpoint/build.py", "checkpoint/io.py", "checkpoint/summary.py",
                 "checkpoint/loading.py", "checkpoint/atomic.py", "trainers/records.py", "trainers/record_sections.py", "trainers/planning.py", "streaming/checks.py", "streaming/host.py", "notices.py",
                 "hub/__init__.py", "hub/card.py", "hub/upload.py", "hub/push.py",
                 "cli.py", "plan_cli.py",
                 "assets/__init__.py", "memory/preflight.py"]


def heavy_top_level_imports(source: str) -> list[str]:
    """Heavy packages imported at module level (not inside functions, classes' methods or
    TYPE_CHECKING blocks)."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try, ast.With)) else [node]:
            if isinstance(sub, ast.Import):
                found += [a.name for a in sub.names if a.name.split(".")[0] in HEAVY]
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.module.split(".")[0] in HEAVY:
                found.append(sub.module)
    return found


def test_light_modules_have_no_heavy_top_level_imports():
    for rel in LIGHT_MODULES:
        assert heavy_top_level_imports((ROOT / rel).read_text()) == [], rel


def test_the_check_catches_an_added_import_torch():
    # control: the same check fails on deg_hf/__init__.py with a top-level `import torch` added
    source = (ROOT / "__init__.py").read_text()
    assert heavy_top_level_imports("import torch\n" + source) == ["torch"]
    assert heavy_top_level_imports(source + "\nfrom trl import DPOTrainer\n") == ["trl"]


def _imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    return {m.split(".")[0] for m in out}


def test_import_deg_hf_and_its_config_import_none_of_the_heavy_packages():
    mods = _imported_after("import deg_hf, deg_hf.config, deg_hf.trainers.mixin; deg_hf.__version__")
    assert not mods & set(HEAVY), mods & set(HEAVY)


def test_importtime_confirms_it():
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import deg_hf"],
                         capture_output=True, text=True, check=True).stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in err.splitlines() if "|" in line}
    assert "deg_hf" in imported and not imported & set(HEAVY)


def test_public_names_resolve_lazily():
    mods = _imported_after("import deg_hf; deg_hf.StreamedDPOTrainer")
    assert "trl" in mods  # resolving a trainer imports its stack, on first use only
