"""hpc.config.diskspace: the login node's look at where a job writes, against real file systems
(small tmpfs mounts; root) and the real models' sizes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpc.config.diskspace import check_space, checkpoint_bytes, model_parameters
from hpc.errors import UserError
from tests.conftest import require
from tests.support.runs import ROOT
from trainers.config import ModelConfig
from trainers.models import build_model


@pytest.mark.parametrize(
    ("name", "hidden", "channels", "shape", "classes"),
    [("mlp", [256, 128], [], (1, 8, 8), 10), ("cnn", [128], [32, 64], (1, 8, 8), 10), ("cnn", [64], [16], (3, 32, 32), 100), ("mlp", [], [], (5,), 3)],
)
def test_the_login_nodes_count_of_a_built_in_model_is_the_built_models(name, hidden, channels, shape, classes):
    model = build_model(ModelConfig(name=name, hidden_sizes=hidden, channels=channels), shape, classes)
    built = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert model_parameters(name, hidden, channels, shape, classes) == built


@pytest.fixture
def mounted(tmp_path):
    made = []

    def mount(options: str):  # noqa: ANN202
        where = tmp_path / f"disk{len(made)}"
        where.mkdir()
        done = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode == 0
        require(done, "root and tmpfs mounts")
        made.append(where)
        return where

    yield mount
    for where in made:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_read_only_run_root_is_refused_and_a_small_one_warned_of(mounted):
    read_only = mounted("ro,size=1m")
    with pytest.raises(UserError, match=rf"run_root={read_only}/runs: the file system at {read_only} is read-only"):
        check_space("run_root", str(read_only / "runs"), None, 2)
    small = mounted("size=1m")
    each = checkpoint_bytes(100_000, "sgd")  # 800 kB: three do not fit in 1 MiB
    warned = check_space("run_root", str(small / "runs"), each, 2)
    assert warned is not None and warned.startswith(f"warning: run_root={small}/runs: 1 MiB free on {small}, the job's checkpoints take about 2.3 MiB")
    assert check_space("run_root", str(small / "runs"), checkpoint_bytes(10_000, "adamw"), 2) is None  # 120 kB each: fits


def test_launch_py_refuses_a_read_only_run_root_in_one_line(mounted, tmp_path):
    read_only = mounted("ro,size=1m")
    ran = subprocess.run([sys.executable, str(ROOT / "launch.py"), f"run_root={read_only}/runs"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    refusal = f"error: run_root={read_only}/runs: the file system at {read_only} is read-only; choose a writable run_root"
    assert ran.returncode != 0 and ran.stderr.strip() == refusal
