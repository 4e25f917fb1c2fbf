"""pytest plugin: TRL's own DPO and KTO test files, unchanged, run offline against deg_hf.

Loaded with ``-p trl_compat`` (``scripts/compat`` on ``PYTHONPATH``) by ``scripts/compat/run.py``.
Environment:

* ``DEG_COMPAT_MODE``: ``plain`` (TRL's own classes: the baseline), ``resident``
  (``StreamedDPOTrainer`` / ``StreamedKTOTrainer`` with ``stream_layers=False``: their config names
  are swapped for ``Streamed*Config`` subclasses whose default is resident) or ``streamed`` (only
  the trainer names swapped: TRL's plain configs, deg_hf's default settings).
* ``DEG_COMPAT_STANDINS``: directory of the offline stand-ins (:mod:`standins`), written on first
  use; ``HF_HOME`` and the offline switches point the Hub libraries at it before they are imported.
* ``DEG_COMPAT_RESULTS``: a JSON file that receives every test's outcome and, for a failure or a
  skip, its one-line reason.

A test that needs a Hub repository with no stand-in here (another architecture, a vision-language
model, the image or tool-call datasets) is skipped, naming the repository. The test modules'
``load_dataset`` is pointed at the stand-in datasets; every other name they import is TRL's.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import standins  # noqa: E402

MODE = os.environ.get("DEG_COMPAT_MODE", "plain")
if MODE not in ("plain", "resident", "streamed"):
    raise pytest.UsageError(f"DEG_COMPAT_MODE must be plain, resident or streamed, got {MODE!r}")
_STANDINS = os.environ.get("DEG_COMPAT_STANDINS")
if _STANDINS:
    # before huggingface_hub, transformers or datasets are imported (writing the stand-ins imports
    # them): they read these settings once, at import
    os.environ.update(standins.environment(_STANDINS))
    standins.write_all(_STANDINS)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _bridge_helper_skew() -> None:
    """The newest TRL tests stored here come from before the installed TRL dropped
    ``trl.import_utils.is_joblib_available``, which their ``testing_utils`` helper still imports:
    put the one missing predicate back (the test files themselves run unchanged)."""
    import importlib
    import importlib.util

    utils = importlib.import_module("trl.import_utils")
    if not hasattr(utils, "is_joblib_available"):
        utils.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None


_bridge_helper_skew()

_HUB_ID = re.compile(r"trl-internal-testing/[\w.-]+")
_AVAILABLE = set(standins.MODELS) | set(standins.DATASETS)
_RESULTS: dict[str, dict] = {}


def _body_source(function) -> str:
    """The test function's source without its decorators (a parametrize list names ids the chosen
    parameters may not use)."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return ""
    match = re.search(r"^\s*def ", source, re.M)
    return source[match.start():] if match else source


def _missing_ids(item) -> list[str]:
    wanted = set(_HUB_ID.findall(_body_source(getattr(item, "function", None))))
    callspec = getattr(item, "callspec", None)
    for value in (callspec.params.values() if callspec is not None else ()):
        if isinstance(value, str):
            wanted |= set(_HUB_ID.findall(value))
    return sorted(wanted - _AVAILABLE)


def _load_dataset(path, *args, **kwargs):
    import datasets

    if isinstance(path, str) and path.startswith("trl-internal-testing/"):
        return standins.load_dataset(os.environ["DEG_COMPAT_DATASETS"], path, *args, **kwargs)
    return datasets.load_dataset(path, *args, **kwargs)


def _swapped_names() -> dict[str, object]:
    if MODE == "plain":
        return {}
    import deg_hf

    names = {"DPOTrainer": deg_hf.StreamedDPOTrainer, "KTOTrainer": deg_hf.StreamedKTOTrainer}
    if MODE == "resident":
        names.update(DPOConfig=_resident_config("DPO"), KTOConfig=_resident_config("KTO"))
    return names


def _resident_config(task: str):
    """``Streamed<task>Config`` with ``stream_layers=False`` as its default, defined at this module's
    top level so that datasets can pickle it when it fingerprints a map over the arguments."""
    from dataclasses import dataclass

    import deg_hf

    name = f"Resident{task}Config"
    if name not in globals():
        base = getattr(deg_hf, f"Streamed{task}Config")
        cls = dataclass(type(name, (base,), {"__annotations__": {"stream_layers": bool}, "stream_layers": False,
                                             "__module__": __name__, "__qualname__": name}))
        globals()[name] = cls
    return globals()[name]


def pytest_collection_modifyitems(config, items):
    swapped = _swapped_names()
    patched = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ not in patched:
            patched.add(module.__name__)
            if hasattr(module, "load_dataset"):
                module.load_dataset = _load_dataset
            for name, value in swapped.items():
                if hasattr(module, name):
                    setattr(module, name, value)
        missing = _missing_ids(item)
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)} from the Hub (no offline stand-in)"))


def _reason(report) -> str:
    if report.skipped:
        longrepr = report.longrepr
        return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:300] if text.strip() else "failed"


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        entry = _RESULTS.setdefault(report.nodeid, {"outcome": "passed"})
        if report.outcome == "passed" and entry["outcome"] != "passed":
            return  # a teardown after a failure does not clear it
        if report.outcome != "passed" and entry["outcome"] == "failed":
            return  # keep the first failure
        entry["outcome"] = report.outcome
        if report.outcome != "passed":
            entry["reason"] = _reason(report)
            entry["when"] = report.when
            crash = getattr(report.longrepr, "reprcrash", None)
            if crash is not None and report.failed:
                import linecache

                entry["line"] = linecache.getline(crash.path, crash.lineno).strip()  # the failing statement


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("DEG_COMPAT_RESULTS")
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump({"mode": MODE, "results": _RESULTS}, fh, indent=1, sort_keys=True)
