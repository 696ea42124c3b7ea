"""A non-editable install used from another directory finds the shipped spaces and workloads,
and the distribution is named so that installing it by name installs this project."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from tests.conftest import ROOT

# "autotune" on PyPI is an unrelated project (hyperparameter tuning, 2018): `pip install
# autotune[png]` would install it. This project is distributed as DISTRIBUTION; the import name
# and the command stay `autotune`.
DISTRIBUTION = "autotune-train"
TAKEN = {"autotune"}  # names on PyPI that belong to other projects (PEP 503 normalized)


def normalize(name: str) -> str:
    """PEP 503: runs of -, _ and . are one -, case folded (how pip and PyPI compare names)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_distribution_name_is_ours() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert normalize(project["name"]) == DISTRIBUTION
    assert normalize(project["name"]) not in TAKEN
    assert project["scripts"] == {"autotune": "autotune.cli:main"}  # the command keeps its name
    assert {"png", "postgres"} <= set(project["optional-dependencies"])


def test_every_package_of_the_source_tree_is_shipped() -> None:
    """The package list is explicit: a folder that becomes a package must be named there, or a
    non-editable install lacks it (an editable one, as the tests use, would not notice)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
                 ["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "autotune").rglob("__init__.py") if "__pycache__" not in p.parts}
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"


def test_wheel_ships_search_spaces_and_objectives(tmp_path: Path) -> None:
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = wheels.glob("autotune_train-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        # The wheel's own metadata sits at its top; the bootstrap's (Lightning's entry points
        # for trials) inside the package, where no installer reads it.
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        assert f"\nName: {DISTRIBUTION}\n" in archive.read(metadata).decode()
        site = "autotune/bootstrap/site/"
        assert {f"{site}sitecustomize.py",
                f"{site}autotune_bootstrap-0.dist-info/entry_points.txt"} <= set(names)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    code = ("import autotune, autotune.config.space as s, autotune.workloads as w;"
            "print(autotune.__file__);"
            "print(sorted(s.builtin_spaces()), sorted(w.builtin_workloads()));"
            "print(s.load_space('default').name, w.resolve('bert').seq_len)")
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True,
                         text=True, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                         check=True).stdout.splitlines()
    assert out[0].startswith(str(target))  # the installed copy, not the source tree
    assert "'default'" in out[1] and "'bert'" in out[1] and "'mlp'" in out[1]
    assert out[2] == "default 128"
