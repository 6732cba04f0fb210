"""A Python error on one rank ends every rank at once (MPI_Abort), not after a hang.

The error comes from what only rank 1 reads: its own file of a committed checkpoint, rewritten
without the RNG states it must hold (and its checksum updated, so the checkpoint still
verifies). On resume rank 1 fails restoring its RNG, while ranks 0 and 2 go on to their first
collective and would wait there forever (the watchdog is off here); labels or shapes a data file
could break are refused up front for every rank alike."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.simcluster import end_process
from tests.support.runs import logged_steps, rank_pids, resume_command, run_dirs, run_launch
from trainers.checkpoint.checkpointer import sha256_of
from trainers.checkpoint.layout import MARKER, rank_file, step_dir_name
from trainers.checkpoint.tensorfile import write_tensor_file

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

RANKS, BAD_RANK, STEPS = 3, 1, 2


def break_rank_file(checkpoint: Path, rank: int) -> None:
    """Replace one rank's file with one lacking its RNG states; keep the checkpoint verifiable."""
    path = checkpoint / rank_file(rank)
    write_tensor_file(path, {"rng": {}})
    marker = json.loads((checkpoint / MARKER).read_text())
    marker["files"][rank_file(rank)] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    (checkpoint / MARKER).write_text(json.dumps(marker))


def test_one_ranks_python_error_ends_all_ranks_at_once_with_the_error_in_its_log(tmp_path):
    first = run_launch(
        f"resources.tasks_per_node={RANKS}", f"trainer.max_steps={STEPS}", "trainer.watchdog_s=null", "checkpoint.every_minutes=null", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    break_rank_file(run_dir / "checkpoints" / step_dir_name(STEPS), BAD_RANK)
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace(f"max_steps: {STEPS}", "max_steps: null"))
    command, env = resume_command(run_dir)
    resumed = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        code = resumed.wait(timeout=120)  # without the abort: ranks 0 and 2 wait forever
    finally:
        resumed.kill()
        for pid in rank_pids(run_dir):
            end_process(pid)
    assert code == 1, resumed.stderr.read()[-2000:]  # the failing rank's MPI_Abort(1), passed on by mpirun
    deadline = time.monotonic() + 30
    while rank_pids(run_dir):
        assert time.monotonic() < deadline, f"ranks still running after the job ended: {rank_pids(run_dir)}"
        time.sleep(0.05)  # polling the process table: the launcher may return a moment before its ranks are gone
    log = (run_dir / "logs" / f"rank-{BAD_RANK:05d}.log").read_text()
    assert f"rank {BAD_RANK} failed; aborting all {RANKS} ranks" in log
    assert "KeyError: 'python'" in log
    assert "KeyError need not repeat: counted as a failure, like a lost rank" in log  # hpc.rank.failures: not the user's deterministic error
    assert logged_steps(run_dir) == STEPS  # no rank finished a step after the failure
