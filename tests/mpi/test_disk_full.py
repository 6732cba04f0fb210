"""The run's file system refusing writes, for real (a small tmpfs; root): filled by a neighbour,
remounted read-only mid-run, or too small for the next save. Each run ends in one line on the
console naming the error, the path, the free space, the kept checkpoint and what to do, with no
traceback and no MPI_ABORT banner; hpc.status says FAILED and why, even where result.json could
not be written; no staging is left; and once the file system is back, the command the line
names resumes the run to the same weights as an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.rundir import RunDir
from hpc.runroots import remembered
from hpc.verify.compare import compare_states, final_state
from tests.conftest import require
from tests.support.runs import ROOT, fixtures_env, resume_command, run_dirs, run_launch

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

# The tests' regression task; on rank 1, at its 12th step, the file system goes (tests/fixtures/mytasks/filling.py)
TASK = [
    *("task._target_=mytasks.filling.Filling", "+task.hidden=64", "+task.samples=1024", "+task.at_step=13", "trainer.epochs=2"),
    *("checkpoint.every_steps=5", "checkpoint.async_save=false"),  # step 10 committed before step 13, every time
]


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode == 0
    require(mounted, "root and tmpfs mounts (for a real full or read-only disk)")
    yield disk
    while subprocess.run(["umount", "-l", str(disk)], capture_output=True).returncode == 0:
        pass  # a read-only bind mount over it too


def status_line(run_dir: Path) -> str:
    shown = subprocess.run([sys.executable, "-m", "hpc.status", str(run_dir)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def assert_one_line_end(ended: subprocess.CompletedProcess[str], words: str, disk: Path, kept: int) -> str:
    """The run's end: exit 1, its one error line (returned), no traceback, no MPI banner."""
    out = ended.stdout + ended.stderr
    assert ended.returncode == 1, out[-3000:]
    lines = [line for line in out.splitlines() if "error: " in line]
    assert len(lines) == 1, out[-3000:]
    pattern = rf"error: {words} on {re.escape(str(disk))} \(\S+ \S+ free of 4 MiB\) writing {re.escape(str(disk))}/\S+: "
    pattern += rf"the run stopped at step \d+; its newest committed checkpoint is step {kept}; .+, then bash \S+/command.txt$"
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in out and "MPI_ABORT" not in out and "Primary job" not in out, out[-3000:]
    return lines[0]


@pytest.mark.parametrize("how", ["fill", "read-only"])
def test_a_file_system_that_goes_mid_run_ends_it_in_one_line_and_the_resume_is_exact(small_disk, tmp_path, how):
    env = fixtures_env()
    job = [*TASK, f"+task.disk={small_disk}", f"+task.how={how}", f"+task.once={tmp_path / 'happened'}"]
    ended = run_launch(*job, cwd=small_disk, env=env)
    words = "no space left" if how == "fill" else "read-only file system"
    assert_one_line_end(ended, words, small_disk, kept=10)
    (run_dir,) = run_dirs(small_disk)
    shown = status_line(run_dir)
    assert re.search(r"\bFAILED\b", shown) and ("disk full" if how == "fill" else "read-only file system") in shown, shown
    assert not list((run_dir / "checkpoints").glob(".tmp-*")), "a save's staging was left"
    if how == "read-only":  # nothing could be written in the run dir: the end went to this machine's fallback
        assert not (run_dir / "result.json").exists() and RunDir(run_dir).end_fallback.is_file()
        return  # its resume is the fill case's (a launch less: the suite's 20 minutes)

    # The file system back: the line's command resumes from step 10, to an uninterrupted run's weights
    (small_disk / "neighbour.bin").unlink()
    command, resume_env = resume_command(run_dir)
    resumed = subprocess.run(command, env={**resume_env, "PYTHONPATH": env["PYTHONPATH"]}, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = RunDir(run_dir).read_result()
    assert result["status"] == "completed" and result["resumed_from"] == 10, result
    assert "COMPLETED" in status_line(run_dir)
    (tmp_path / "reference").mkdir()
    reference = run_launch(*job, cwd=tmp_path / "reference", env=env)  # `once` exists: nothing happens to this one
    assert reference.returncode == 0, reference.stderr[-3000:]
    (reference_dir,) = run_dirs(tmp_path / "reference")
    assert compare_states(final_state(run_dir)[0], final_state(reference_dir)[0]).differing == []


# About 2 MiB per checkpoint: the first fits in what the run's frozen code (1.6 MiB) leaves of 4
# MiB, with 0.3 MiB to spare (hidden [512,512], 2.36 MiB, missed by 12 KiB), a second does not.
BIG = ["model.hidden_sizes=[448,448]", "trainer.epochs=2", "checkpoint.every_steps=5", "checkpoint.every_minutes=null"]


def test_a_save_that_does_not_fit_ends_the_run_keeps_the_previous_checkpoint_and_no_staging(small_disk):
    """The default asynchronous save: its writer threads fail, the next step's handshake finds
    it and every rank drops it. A synchronous save takes the same handshake at once
    (SaveCoordinator.finish_pending), as the two runs above do at every save."""
    ended = run_launch(*BIG, cwd=small_disk)
    line = assert_one_line_end(ended, "no space left", small_disk, kept=5)
    assert (small_disk / "runs").absolute() in remembered()  # launch.py's run root: hpc.status finds it from anywhere
    assert "/checkpoints/.tmp-step-000000010/" in line, line  # the save of step 10 is what the disk refused
    (run_dir,) = run_dirs(small_disk)
    assert not list((run_dir / "checkpoints").glob(".tmp-*")) and not (run_dir / "checkpoints" / "step-000000010").exists()
    assert "disk full" in status_line(run_dir)

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    command, env = resume_command(run_dir)
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = RunDir(run_dir).read_result()
    assert result["status"] == "completed" and result["resumed_from"] == 5


HANDLE_SCRIPT = ROOT / "tests" / "fixtures" / "scripts" / "handle" / "train.py"


def test_a_script_started_by_torchrun_ends_in_one_line_and_the_same_command_resumes(small_disk, tmp_path):
    """The run handle without launch.py: rank 1 fills the disk after step 12 (saves every 5).
    Each rank exits 1 with no traceback of its own (torchrun then prints its ChildFailedError
    summary, as for any failed child); rank 0's line names the command that resumes: the same."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'fixtures'}"}
    script = [str(HANDLE_SCRIPT), "--steps", "24", "--save-every", "5", "--run-dir", str(small_disk / "run"), "--out", str(tmp_path / "out.json")]
    fill = ["--fill", str(small_disk), "--fill-at", "12", "--fill-once", str(tmp_path / "filled")]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script, *fill]
    ended = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = ended.stdout + ended.stderr
    assert ended.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "error: " in line]
    assert len(lines) == 1, out[-3000:]
    pattern = rf"error: no space left on {re.escape(str(small_disk))} \(\S+ \S+ free of 4 MiB\) writing \S+: the run stopped at step \d+; "
    run = re.escape(str(small_disk / "run"))
    # step 10 committed, or its asynchronous save still being written when the disk filled: step 5
    pattern += rf"its newest committed checkpoint is step (5|10); free space, then start the same command again \(it resumes {run}\)$"
    told = re.search(pattern, lines[0])
    assert told, lines[0]
    assert "StorageFailure" not in out and "OSError" not in out and "Errno" not in out, out[-3000:]
    recorded = RunDir(small_disk / "run").read_result()  # end.json: the disk took no new file
    assert recorded["status"] == "failed" and recorded["reason"] == "disk full" and recorded["error"] == lines[0].split("error: ", 1)[1]

    (small_disk / "neighbour.bin").unlink()
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    done = json.loads((tmp_path / "out.json").read_text())
    assert done["resumed_from"] == int(told.group(1)) and done["step"] == 24
