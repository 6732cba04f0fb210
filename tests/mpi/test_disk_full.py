"""A real full disk (a 4 MiB tmpfs) under a training run: the save that does not fit fails in
one line, the previous committed checkpoint stays loadable, and once there is room the run
resumes from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import require
from tests.support.runs import ROOT, resume_command, run_dirs
from trainers.checkpoint.checkpointer import Checkpointer

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

# About 2.5 MB per checkpoint (weights + momentum): the first fits in 4 MiB, a second does not.
JOB = ["model.hidden_sizes=[512,512]", "trainer.epochs=2", "checkpoint.every_steps=5", "checkpoint.every_minutes=null", "checkpoint.async_save=false"]


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode == 0
    require(mounted, "root and tmpfs mounts (for a real full disk)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_save_on_a_full_disk_fails_cleanly_and_the_previous_checkpoint_resumes(small_disk):
    first = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *JOB, f"run_root={small_disk / 'runs'}"], cwd=small_disk.parent, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 1, first.stderr[-2000:]  # the failing rank's MPI_Abort(1), passed on by mpirun
    (run_dir,) = run_dirs(small_disk)
    log = (run_dir / "logs" / "rank-00000.log").read_text()
    assert "No space left on device; the previous committed checkpoint is intact" in log, log[-2000:]
    assert "Traceback" not in log
    restored = Checkpointer(run_dir / "checkpoints", 0, 2, keep=2).load_latest()
    assert restored is not None and restored[0] == 5

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    command, env = resume_command(run_dir)
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["resumed_from"] == 5
