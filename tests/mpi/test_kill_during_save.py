"""SIGKILL a rank while a checkpoint is being written, again and again: every next start resumes
from exactly the newest checkpoint committed before the kill, the interrupted save is never
committed, and a corrupted newest checkpoint is skipped for the previous one.

Every kill lands inside a save, by construction rather than by luck: before each start the test
puts a named pipe where rank 0 will write the shared state of a chosen future save. Rank 0's
writer thread then writes into the pipe as fast as the test reads; the test reads a random
number of bytes of the file and kills rank 0 or rank 1 there. What the writer had written is
then left on disk as a regular file, exactly what a real kill mid-write leaves behind.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.runs import rank_pids, resume_command, run_dirs, run_launch
from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.layout import SHARED, step_dir_name
from trainers.watchdog import heartbeat_file

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

EVERY = 2
JOB = ["trainer.epochs=3", f"checkpoint.every_steps={EVERY}", "checkpoint.every_minutes=null", "checkpoint.keep=3"]
KILLS = 2  # one of each rank (victim = kill % 2); each start costs MPI and torch start-up (5-15 s on a loaded 2-core machine)


def newest_committed(run_dir: Path) -> int:
    """The newest checkpoint whose marker and checksums hold (what a start must resume from)."""
    return Checkpointer(run_dir / "checkpoints", 0, 2, keep=3).committed()[-1].step


def resumed_steps(run_dir: Path, rank: int) -> list[int]:
    log = (run_dir / "logs" / f"rank-{rank:05d}.log").read_text()
    return [int(step) for step in re.findall(r"resumed from checkpoint step (\d+)", log)]


def assert_ranks_end(run_dir: Path) -> None:
    deadline = time.monotonic() + 30
    while rank_pids(run_dir):
        assert time.monotonic() < deadline, f"ranks still running 30 s after the launcher ended: {rank_pids(run_dir)}"
        time.sleep(0.05)  # polling the process table: the launcher may return a moment before its ranks are gone


def drain(reader: int) -> bytes:
    """The rest of what the killed job wrote into the pipe, up to its end (the launcher may exit
    a moment before the last rank holding the pipe is gone)."""
    rest = bytearray()
    deadline = time.monotonic() + 60
    while True:
        try:
            chunk = os.read(reader, 1 << 20)
        except BlockingIOError:
            assert time.monotonic() < deadline, "a rank still holds the checkpoint file 60 s after the launcher ended"
            time.sleep(0.01)  # polling the pipe for its writer's end
            continue
        if not chunk:
            return bytes(rest)
        rest += chunk


def kill_inside_save(command: list[str], env: dict[str, str], run_dir: Path, save_step: int, cut: int, victim: int) -> tuple[int, int]:
    """Start the ranks; once rank 0 has written `cut` bytes of the shared state of the save at
    `save_step`, SIGKILL rank `victim`. Leaves the bytes written so far as a partial file;
    returns (the newest committed step at the kill, the launcher's exit code)."""
    tmp = run_dir / "checkpoints" / f".tmp-{step_dir_name(save_step)}"
    tmp.mkdir(exist_ok=True)  # may hold what an earlier kill left of the same save
    pipe = tmp / SHARED
    pipe.unlink(missing_ok=True)
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # the writer's open() succeeds at once
    written = bytearray()
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while len(written) < cut:
            assert proc.poll() is None, "the job ended before the save was under way"
            assert time.monotonic() < deadline, f"no save at step {save_step} within 120 s"
            try:
                chunk = os.read(reader, cut - len(written))
            except BlockingIOError:
                chunk = b""
            if not chunk:
                time.sleep(0.001)  # polling the pipe: rank 0 has not reached the save, or writes on
            written += chunk
        at_kill = newest_committed(run_dir)  # rank 0 cannot commit anything while this save is open
        pid = json.loads(heartbeat_file(run_dir / "heartbeats", victim).read_text())["pid"]
        assert pid in rank_pids(run_dir), f"heartbeat pid {pid} of rank {victim} is not a running rank"
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=120)
        written += drain(reader)
    finally:
        os.close(reader)
    pipe.unlink()
    pipe.write_bytes(bytes(written))
    return at_kill, code


def test_sigkill_inside_saves_resumes_from_the_newest_committed_checkpoint(tmp_path):
    rng = random.Random(1234)
    first = run_launch(*JOB, "trainer.max_steps=4", cwd=tmp_path)  # makes the run dir, commits step 4
    assert first.returncode == 0, first.stderr
    (run_dir,) = run_dirs(tmp_path)
    shared_bytes = (run_dir / "checkpoints" / step_dir_name(4) / SHARED).stat().st_size
    command, env = resume_command(run_dir)
    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace("max_steps: 4", "max_steps: null"))
    expected_resumes: list[int] = []
    for kill in range(KILLS):
        committed = newest_committed(run_dir)
        save_step = committed + EVERY * rng.randint(1, 3)
        cut = rng.randint(1, shared_bytes - 4096)  # never the whole file: its fsync would fail on a pipe
        victim = kill % 2  # the writer of the shared state, and a rank that has written its part
        at_kill, code = kill_inside_save(command, env, run_dir, save_step, cut, victim)
        expected_resumes.append(committed)
        # mpirun ends with the kill's 137, or with 1 when a surviving rank saw its peer vanish
        # first and aborted: the README promises no code here, only that every rank ends.
        assert code != 0
        assert_ranks_end(run_dir)
        # The start resumed from what was committed before it; the save the kill cut short was never committed.
        assert resumed_steps(run_dir, 0) == resumed_steps(run_dir, 1) == expected_resumes
        assert at_kill == save_step - EVERY
        assert not (run_dir / "checkpoints" / step_dir_name(save_step)).exists()
        assert newest_committed(run_dir) == at_kill
        print(f"start {kill + 1} resumed from step {committed}; rank {victim} killed at byte {cut} of the save at step {save_step}")

    # A corrupted newest checkpoint is skipped: the job resumes from the one before and finishes.
    *_, before, newest = Checkpointer(run_dir / "checkpoints", 0, 2, keep=3).committed()
    damaged = run_dir / "checkpoints" / step_dir_name(newest.step) / SHARED
    data = bytearray(damaged.read_bytes())
    data[len(data) // 3] ^= 0x5A
    damaged.write_bytes(bytes(data))
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    summary = json.loads((run_dir / "result.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == before.step
    assert resumed_steps(run_dir, 0) == [*expected_resumes, before.step]
    log = (run_dir / "logs" / "rank-00000.log").read_text()
    assert f"skipping checkpoint: {step_dir_name(newest.step)}: {SHARED} does not match its checksum" in log
