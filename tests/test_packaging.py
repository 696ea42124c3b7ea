"""A non-editable install used from another directory finds the shipped spaces and workloads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_wheel_ships_search_spaces_and_objectives(tmp_path: Path) -> None:
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = wheels.glob("autotune-*.whl")
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
