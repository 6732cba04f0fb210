"""What launch.py does before a job id: one Hydra composition of a single run, and no heavy
library (torch, numpy, h5py) on the way, once the data set was checked."""

from __future__ import annotations

import subprocess
import sys

from tests.support.runs import ROOT

COUNTING = """
import atexit, runpy, sys
import hydra
calls = []
original = hydra.compose
def counted(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)
hydra.compose = counted  # the compose API: the one way launch.py composes
atexit.register(lambda: print("compositions:", len(calls), "heavy:", sorted(m for m in ("torch", "numpy", "h5py") if m in sys.modules)))
sys.argv = ["launch.py", *sys.argv[1:]]
runpy.run_path("launch.py", run_name="__main__")
"""


def launch_counting(*overrides: str, cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", COUNTING, *overrides, f"run_root={cwd / 'runs'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_single_run_is_composed_once_and_imports_nothing_heavy(tmp_path):
    first = launch_counting("dry_run=true", "cluster=simulated", cwd=tmp_path)  # checks the data set once
    assert first.returncode == 0, first.stderr
    again = launch_counting("dry_run=true", "cluster=simulated", "optim.lr=0.2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "# sbatch script" in again.stdout and "lr: 0.2" in again.stdout
    assert again.stdout.strip().endswith("compositions: 1 heavy: []"), again.stdout[-300:]


def test_a_refused_override_is_still_one_line_and_leaves_nothing(tmp_path):
    refused = launch_counting("cluster=simulated", "optim.lrr=0.2", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "optim.lrr" in refused.stderr
    assert not (tmp_path / "runs").exists()
