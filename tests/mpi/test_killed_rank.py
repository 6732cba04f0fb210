"""A rank the kernel's out-of-memory killer ends, for real (a memory cgroup with a small limit;
root): the launcher says so in one line (which rank, its pid, where the run stopped, what was
kept, what to do), hpc.status says FAILED and why, and the run resumes from its checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.rundir import RunDir
from tests.conftest import require
from tests.support.runs import ROOT, fixtures_env, resume_command, run_dirs, run_launch

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]


@pytest.fixture
def small_memory(tmp_path):
    """A memory cgroup of 150 MiB (cgroup v1's memory controller, or v2's)."""
    name = f"hpctk-test-{os.getpid()}-{tmp_path.name}"
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.subtree_control"
    made = None
    if os.geteuid() == 0 and (v1 / "cgroup.procs").exists():
        made, limit = v1 / name, "memory.limit_in_bytes"
    elif os.geteuid() == 0 and controllers.exists() and "memory" in controllers.read_text().split():
        made, limit = v2 / name, "memory.max"
    if made is not None:
        made.mkdir()
        (made / limit).write_text(str(150 << 20))
    require(made is not None, "root and a memory cgroup (for a real out-of-memory kill)")
    yield made
    made.rmdir()


def test_a_rank_the_oom_killer_ends_is_named_in_one_line_and_the_run_resumes(small_memory, tmp_path):
    env = fixtures_env()
    job = ["task._target_=mytasks.hungry.Hungry", "+task.hidden=64", "+task.samples=1024", "trainer.epochs=2", "checkpoint.every_steps=5"]
    job += ["checkpoint.async_save=false", f"+task.cgroup={small_memory}", f"+task.once={tmp_path / 'happened'}"]
    ended = run_launch(*job, cwd=tmp_path, env=env)
    assert ended.returncode == 137, ended.stderr[-3000:]
    lines = [line for line in ended.stderr.splitlines() if line.startswith("error: ")]
    pattern = r"error: rank 1 \(pid \d+\) was killed by the kernel's out-of-memory killer: the run stopped at step 1[01]; "
    pattern += r"its newest committed checkpoint is step 10; give it more memory \(or a smaller batch\), then bash \S+/command.txt$"
    assert len(lines) == 1 and re.match(pattern, lines[0]), ended.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    shown = subprocess.run([sys.executable, "-m", "hpc.status", str(run_dir)], capture_output=True, text=True, timeout=60, cwd=ROOT).stdout
    assert "FAILED" in shown and "out of memory: rank 1:" in shown, shown

    command, resume_env = resume_command(run_dir)
    resumed = subprocess.run(command, env={**resume_env, "PYTHONPATH": env["PYTHONPATH"]}, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = RunDir(run_dir).read_result()
    assert result["status"] == "completed" and result["resumed_from"] == 10, result
