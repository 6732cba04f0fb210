"""SIGKILL a rank at random moments while checkpoints are being written: every next start must
find a valid committed checkpoint, and a corrupted newest one is skipped for the previous."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest

from tests.support.runs import logged_steps, rank_pids, resume_command, run_dirs, run_launch
from trainers.checkpoint import Checkpointer, step_dir_name

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

JOB = ["model.hidden_sizes=[1024,1024]", "trainer.epochs=4", "checkpoint.every_steps=2", "checkpoint.every_minutes=null", "checkpoint.keep=3"]
KILLS = 8


def test_sigkill_during_saves_never_leaves_the_job_without_a_checkpoint(tmp_path):
    rng = random.Random(1234)
    first = run_launch(*JOB, "trainer.max_steps=4", cwd=tmp_path)  # makes the run dir, commits step 4
    assert first.returncode == 0, first.stderr
    (run_dir,) = run_dirs(tmp_path)
    command, env = resume_command(run_dir)
    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace("max_steps: 4", "max_steps: null"))
    during_write = 0
    for _ in range(KILLS):
        start = logged_steps(run_dir)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        target = start + rng.randint(1, 5)
        deadline = time.monotonic() + 60
        while logged_steps(run_dir) < target:
            assert proc.poll() is None and time.monotonic() < deadline, "job ended or stalled before the kill"
            time.sleep(0.002)  # polling the step log
        time.sleep(rng.uniform(0, 0.02))  # a random moment inside the following steps and saves
        in_flight = bool(list((run_dir / "checkpoints").glob(".tmp-step-*")))
        pids = rank_pids(run_dir)
        os.kill(rng.choice(pids[1:] if len(pids) > 2 else pids), signal.SIGKILL)
        proc.wait(timeout=60)
        during_write += in_flight
        restored = Checkpointer(run_dir / "checkpoints", 0, 2, keep=3).load_latest()
        assert restored is not None, "no loadable checkpoint after a kill"
        assert restored[0] <= logged_steps(run_dir) and restored[2] is not None
    assert during_write >= 3, f"only {during_write} of {KILLS} kills hit a save in flight"

    # A corrupted newest checkpoint is skipped: the job resumes from the one before and finishes.
    # (The newest step-* directory may be a save the last kill interrupted: corrupt the newest
    # committed one, so the checksum is what must catch it.)
    *_, before, newest_committed = Checkpointer(run_dir / "checkpoints", 0, 2, keep=3).committed()
    newest = newest_committed.path
    data = bytearray((newest / "shared.ckpt").read_bytes())
    data[len(data) // 3] ^= 0x5A
    (newest / "shared.ckpt").write_bytes(bytes(data))
    previous = before.step
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    summary = json.loads((run_dir / "result.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == previous
    assert newest.name != step_dir_name(previous)
    assert "does not match its checksum" in (run_dir / "logs" / "rank-00000.log").read_text()
