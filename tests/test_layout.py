"""The house rules that import-linter cannot see (its contracts in pyproject.toml cover what may
import what): Optuna's private APIs are touched in one module only, Optuna's user attributes
are read only by the record and the storage, Optuna is pinned below its next major, and no
module or function grows past the house limits."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "autotune"
STORAGE = PACKAGE / "tuner" / "storage.py"
# Attributes of Optuna objects that are not its public API.
PRIVATE = {"_trial_id", "_storage", "_cached_frozen_trial", "_study_id"}
MAX_FUNCTION_LINES = 60  # its body, after the docstring


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_only_the_storage_module_touches_optunas_private_api() -> None:
    found = []
    for path in _modules():
        if path == STORAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
                found.append(f"{where} .{node.attr}")
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("optuna") and any(p.startswith("_") for p in name.split(".")):
                    found.append(f"{where} import {name}")
    assert found == [], "Optuna internals outside tuner/storage.py: " + ", ".join(found)
    # ... and storage.py really is where they are (the rule is not vacuous).
    text = STORAGE.read_text()
    assert "._trial_id" in text and "optuna.storages._heartbeat" in text


RECORD = PACKAGE / "tuner" / "record"
MAX_MODULE_LINES = 400


def test_only_the_record_and_storage_read_or_write_user_attrs() -> None:
    """Everything else reads typed records (TrialRecord, StudyFacts, StudySnapshot) and writes
    through ``tuner/record/``'s typed functions: a value typed once is never read back, or
    written, by string keys on Optuna's attributes. Reads (``.user_attrs``), writes
    (``set_user_attr``) and queued attributes (``enqueue_trial(..., user_attrs=...)``) are all
    caught."""
    found = []
    for path in _modules():
        if path == STORAGE or RECORD in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr in ("user_attrs", "set_user_attr"):
                found.append(f"{where} .{node.attr}")
            if isinstance(node, ast.keyword) and node.arg == "user_attrs":
                found.append(f"{where} user_attrs=")
    assert found == [], "user attributes touched outside tuner/record/ and tuner/storage.py: " \
        + ", ".join(found)
    # ... and the record really is where they are read and written (the rule is not vacuous).
    assert ".user_attrs" in (RECORD / "read.py").read_text()
    written = (RECORD / "write.py").read_text()
    assert "set_user_attr(" in written and "user_attrs=" in written
    assert "set_user_attr(" in (RECORD / "facts.py").read_text()


def test_no_module_is_longer_than_the_house_limit() -> None:
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == [], f"modules over {MAX_MODULE_LINES} lines (split them along their ideas): " \
        + ", ".join(long)


def test_optuna_is_pinned_below_its_next_major() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (optuna,) = [d for d in deps if re.match(r"optuna(?![-\w])", d)]
    lower = re.search(r">=\s*(\d+)", optuna)
    upper = re.search(r"<\s*(\d+)", optuna)
    assert lower and upper and int(upper.group(1)) == int(lower.group(1)) + 1, optuna


def test_no_function_is_longer_than_a_screen() -> None:
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = node.body
            if len(body) > 1 and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            lines = (node.end_lineno or node.lineno) - body[0].lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert long == [], "split these along their own steps: " + ", ".join(long)


def test_the_integrations_contract_forbids_every_trial_module_but_apply_and_sentinel() -> None:
    """import-linter cannot say "all of the trial but apply": its contract lists the trial's
    modules one by one, and a new one must join the list, or the integrations could import it
    (and, through it, the profile's circle could come back)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in contracts["contracts"]
                   if c["source_modules"] == ["autotune.integrations"]]
    trial = PACKAGE / "trial"
    modules = {f"autotune.trial.{p.stem if p.suffix else p.name}" for p in trial.iterdir()
               if p.suffix == ".py" and p.stem != "__init__" or (p / "__init__.py").is_file()}
    assert "autotune.trial.apply" in modules
    allowed = {"autotune.trial.apply", "autotune.trial.sentinel"}  # steps reads the sentinel
    missing = modules - allowed - set(contract["forbidden_modules"])
    assert not missing, f"add {sorted(missing)} to the integrations' forbidden_modules"
    assert not contracts.get("exclude_type_checking_imports", False)
