"""SIGKILL a rank of a job on the real Slurm: the step ends (srun --kill-on-bad-exit), the job
requeues itself (the sbatch script's EXIT trap) at most `cluster.failure_requeues` times, and
every next start resumes from the newest committed checkpoint. Kills land during a save and are
checked to have: the save in flight is never committed and the job resumes from the one before.
Not requeued: a Python error (it would repeat) and a job someone scancelled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.simcluster import newest_committed_step, parse_job_id, poll, release_when_requeued, restarts, wait_for_resume
from hpc.slurm.slurmctl import TERMINAL_STATES, job_fields, job_state
from tests.conftest import wait_until_done
from tests.support.runs import logged_steps, rank_pids, run_dirs, run_launch, submit_job
from trainers.checkpoint.checkpointer import Checkpointer

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

# failure_requeues=6: room for the kills and for stale step kills (below) on top. No restarts
# inside the allocation: these tests are of the requeue that follows (test_allocation_restart_slurm).
JOB = (
    "cluster=simulated",
    "resources.nodes=2",
    # One rank per node: what these tests prove needs two nodes, not two ranks on each (each rank
    # start costs seconds of CPU on the 2-core test machine; tests/e2e/test_slurm.py runs 2 x 2).
    "resources.tasks_per_node=1",
    "model.hidden_sizes=[1024,1024]",
    "trainer.epochs=2",
    "checkpoint.every_steps=2",
    "checkpoint.every_minutes=null",
    "checkpoint.keep=3",
    "cluster.failure_requeues=6",
    "cluster.allocation_restarts=0",
)
KILLS = 1  # repeated failure requeues: test_a_rank_that_keeps_dying_requeues_the_job_at_most_failure_requeues_times (a second kill here cost 60 s)
# One node, two ranks, long enough never to finish by itself within a test.
ENDLESS = (
    "cluster=simulated",
    "resources.tasks_per_node=2",
    "trainer.epochs=1000",
    "checkpoint.every_steps=5",
    "checkpoint.every_minutes=null",
    "cluster.allocation_restarts=0",
)
RESUMED = "resumed from checkpoint step "


def python_ranks(run_dir: Path) -> list[int]:
    return rank_pids(run_dir)  # what srun runs on every task


def rank_of(pid: int) -> int | None:
    """The Slurm task rank of a running rank process (its SLURM_PROCID), None once it is gone."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(entry.split(b"=", 1)[1]) for entry in environ if entry.startswith(b"SLURM_PROCID=")), None)


def save_in_flight(run_dir: Path) -> int | None:
    """The step of a save begun but not committed (its `.tmp-step-N` is newer than every commit)."""
    committed = newest_committed_step(run_dir)
    try:
        names = os.listdir(run_dir / "checkpoints")
    except FileNotFoundError:
        return None
    steps = [int(name.removeprefix(".tmp-step-")) for name in names if name.startswith(".tmp-step-")]
    return next((step for step in sorted(steps, reverse=True) if step > committed), None)


def is_committed(run_dir: Path, step: int) -> bool:
    return (run_dir / "checkpoints" / f"step-{step:09d}" / "COMMITTED").is_file()


def rank0_pid(run_dir: Path) -> int | None:
    """Rank 0's running process, as its heartbeat names it: where a node's warm process forked
    the rank (hpc.rank.warm), srun's task is only its client, and stopping the client stops no
    save. None while it has none yet, or the heartbeat is an earlier start's."""
    try:
        pid = int(json.loads((run_dir / "heartbeats" / "rank-00000.json").read_text())["pid"])
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, KeyError):
        return None
    return pid if {b"hpc.rank.main", b"hpc.rank.warm"} & set(command) else None


def kill_rank0_during_a_save(run_dir: Path, deadline_s: float = 120) -> tuple[int, int]:
    """SIGKILL rank 0 while a save is in flight: (the step being saved, the newest committed step).
    Rank 0 alone publishes a checkpoint, so it is stopped first (SIGSTOP) and the save is checked
    to be still uncommitted before the kill; a save that committed in that instant is let go and
    the next one is tried. Rank 0's pid is found before the saves are watched: finding it (pgrep)
    takes longer than a save on a loaded machine, and a save seen first was always gone by then."""
    deadline = time.monotonic() + deadline_s
    rank0 = None
    while time.monotonic() < deadline:
        if rank0 is None:
            rank0 = rank0_pid(run_dir)
            time.sleep(0 if rank0 is not None else 0.05)
            continue
        step = save_in_flight(run_dir)
        if step is None:
            time.sleep(0.002)  # a save lasts a few steps' worth of ms; no event announces it
            continue
        os.kill(rank0, signal.SIGSTOP)
        if is_committed(run_dir, step) or save_in_flight(run_dir) != step:
            os.kill(rank0, signal.SIGCONT)  # it committed just now: wait for the next save
            continue
        committed = newest_committed_step(run_dir)
        os.kill(rank0, signal.SIGKILL)
        return step, committed
    raise TimeoutError("no save in flight to kill rank 0 in")


def first_resume_after(log: Path, offset: int) -> int:
    text = log.read_text()[offset:]
    assert RESUMED in text, text[-2000:]
    return int(text.split(RESUMED, 1)[1].split()[0])


def trap_requeues(run_dir: Path) -> int:
    return sum(err.read_text().count("hpc-toolkit: a rank died") for err in (run_dir / "slurm").glob("*/*_0_log.err"))


def state_after_this_run(job_id: str) -> str:
    """The job's state once its current run is over. Not wait_until_done: a requeued job would
    pend and run again, and the test would only time out."""
    poll(lambda: job_state(job_id) not in ("RUNNING", "COMPLETING"), f"job {job_id} to end", timeout_s=60)
    return job_state(job_id)


def holds_for(condition: Callable[[], bool], seconds: float) -> bool:
    """True when `condition` stays true for `seconds`; False as soon as it does not."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not condition():
            return False
        time.sleep(0.2)  # Slurm gives no event for "nothing happened"
    return condition()


def test_sigkill_during_a_save_never_commits_it_and_resumes_from_the_one_before(tmp_path):
    job_id, run_dir = submit_job(*JOB, cwd=tmp_path)
    rank0_log = run_dir / "logs" / "rank-00000.log"
    for kill in range(KILLS):
        poll(lambda: logged_steps(run_dir) >= 6 * (kill + 1) and len(python_ranks(run_dir)) == 2, f"step {6 * (kill + 1)} on 2 ranks")
        before = restarts(job_id)
        log_offset = len(rank0_log.read_text())
        saving, committed = kill_rank0_during_a_save(run_dir)
        poll(lambda: restarts(job_id) > before, f"job {job_id} to requeue itself")  # srun ended: every rank is gone
        assert not is_committed(run_dir, saving) and newest_committed_step(run_dir) == committed, (kill, saving, committed, newest_committed_step(run_dir))
        restored = Checkpointer(run_dir / "checkpoints", 0, 2, keep=3).load_latest()
        assert restored is not None and restored[0] == committed, f"loads {restored and restored[0]}, not the newest committed step {committed}"
        release_when_requeued(job_id, before)  # start it without Slurm's delay
        wait_for_resume(job_id, lambda: RESUMED in rank0_log.read_text()[log_offset:], released_at=restarts(job_id))
        assert first_resume_after(rank0_log, log_offset) == committed, (kill, saving, committed)
    assert wait_until_done(job_id) == "COMPLETED"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["resumed_from"] > 0, result
    # Step ids repeat across requeues (28.0 every time): a kill Slurm still had queued for the
    # SIGKILLed incarnation sometimes reaches the restarted step as SIGTERM (seen in CI). The ranks
    # must then do what they do for any signal: checkpoint, requeue, resume. Each extra restart
    # must be such a clean stop.
    # Such a stale kill can also land just after the ranks finished (seen in CI: all ranks logged
    # "Job completed successfully", then "STEP CANCELLED"): the EXIT trap sees the finished mark,
    # never requeues, and ends the job COMPLETED. Every restart must be one of the two kinds.
    clean_stops = rank0_log.read_text().count("checkpoint committed; external signal: requeueing job")
    assert trap_requeues(run_dir) >= KILLS, (trap_requeues(run_dir), result)
    assert result["restarts"] == trap_requeues(run_dir) + clean_stops, (result["restarts"], trap_requeues(run_dir), clean_stops)


def test_a_rank_that_keeps_dying_requeues_the_job_at_most_failure_requeues_times(tmp_path):
    job_id, run_dir = submit_job(*ENDLESS, "cluster.failure_requeues=1", cwd=tmp_path)
    rank0_log = run_dir / "logs" / "rank-00000.log"
    for kill in range(2):
        five_steps_into_a_start(job_id, run_dir)
        before = restarts(job_id)
        os.kill(next(pid for pid in python_ranks(run_dir) if rank_of(pid) == 1), signal.SIGKILL)
        if kill == 0:
            release_when_requeued(job_id, before)
    state = state_after_this_run(job_id)
    clean_stops = rank0_log.read_text().count("checkpoint committed; external signal: requeueing job")  # stale kills (above)
    assert (state, restarts(job_id)) == ("FAILED", 1 + clean_stops)
    # Failed for good: no requeue comes later (the trap runs before the job ends).
    assert holds_for(lambda: job_state(job_id) == "FAILED" and restarts(job_id) == 1 + clean_stops, 3)
    assert trap_requeues(run_dir) == 1
    # The batch script exits with srun's status: a task killed by signal 9 (128 + 9).
    assert job_fields(job_id)["ExitCode"] == "137:0"


def five_steps_into_a_start(job_id: str, run_dir: Path) -> None:
    """Wait for 5 steps of the job's current start, on 2 ranks (steps.jsonl keeps the earlier
    starts' steps; a kill during MPI start-up ends the job another way, seen in CI). A kill Slurm
    still had queued for the start killed before may stop this one cleanly (see the test above):
    the job requeues itself; start it again and wait for that start."""
    rank0_log = run_dir / "logs" / "rank-00000.log"
    while True:
        start = restarts(job_id)

        def requeued(start: int = start) -> bool:
            return restarts(job_id) > start

        poll(lambda: requeued() or (rank0_log.exists() and f"restart {start}" in rank0_log.read_text()), f"start {start}")
        before = logged_steps(run_dir)
        poll(lambda: requeued() or (logged_steps(run_dir) >= before + 5 and len(python_ranks(run_dir)) == 2), f"5 steps of start {start} on 2 ranks")
        if not requeued():
            return
        release_when_requeued(job_id, start)


def cancel_for_good(job_id: str) -> None:
    """scancel until it sticks: a job that requeues itself after scancel (the bug tested for)
    would otherwise outlive the test's own cleanup. A pending job is cancelled at once."""

    def cancelled() -> bool:
        if job_state(job_id) in ("RUNNING", "PENDING"):
            subprocess.run(["scancel", job_id], capture_output=True)
        return job_state(job_id) in TERMINAL_STATES

    poll(cancelled, f"job {job_id} to stay cancelled")


def test_a_scancelled_job_is_not_requeued(tmp_path):
    job_id, run_dir = submit_job(*ENDLESS, cwd=tmp_path)
    try:
        poll(lambda: logged_steps(run_dir) >= 5, "step 5")
        subprocess.run(["scancel", job_id], check=True)
        assert (state_after_this_run(job_id), restarts(job_id)) == ("CANCELLED", 0)
        steps = logged_steps(run_dir)
        assert holds_for(lambda: job_state(job_id) == "CANCELLED" and restarts(job_id) == 0 and logged_steps(run_dir) == steps, 3)
        assert trap_requeues(run_dir) == 0
        rank0 = run_dir / "logs" / "rank-00000.log"
        poll(lambda: "was cancelled: not requeueing it" in rank0.read_text(), "rank 0 to say the job was cancelled", 30)
        assert "requeueing job" not in rank0.read_text() and "requeue in progress" not in rank0.read_text()
    finally:
        cancel_for_good(job_id)


def test_a_python_error_is_not_requeued(tmp_path):
    data = tmp_path / "digits.h5"
    from trainers.config import DataConfig
    from trainers.data.datasets import resolve_data_path

    data.write_bytes(resolve_data_path(DataConfig()).read_bytes())
    submitted = run_launch("cluster=simulated", "resources.tasks_per_node=2", f"data.path={data}", "hold=true", cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job_id = parse_job_id(submitted.stdout)
    data.unlink()  # every rank fails the same way on every start
    subprocess.run(["scontrol", "release", job_id], check=True)
    assert wait_until_done(job_id) == "FAILED"
    assert restarts(job_id) == 0
    (run_dir,) = run_dirs(tmp_path)
    # Every rank fails alike; the first to fail says it and aborts the others (maybe before they log)
    logs = "".join(log.read_text() for log in sorted((run_dir / "logs").glob("rank-*.log")))
    assert f"job {job_id} will not be requeued" in logs, logs[-2000:]
