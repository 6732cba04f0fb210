"""Stop a local 2-rank job with a signal (a user's task keeping its checkpoints in an object
store), resume it in the same run dir, and compare with an uninterrupted run: identical per-step
losses and model state. The built-in task on converted shards, read by workers, augmented, is
one cell of the verifier's matrix (tests/mpi/test_verify.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from hpc.rank.lifecycle import EXIT_RESUMABLE
from tests.support.runs import (
    fixtures_env,
    logged_steps,
    rank_pids,
    resume_command,
    run_dirs,
    run_launch,
    start_launch,
    state_hash,
    step_losses,
    wait_for_run,
)
from trainers.checkpoint.storage import ObjectStore, stored_checkpoints

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

# Slow enough per step (wide MLP) and long enough (220 steps) that the signals land mid-run,
# even tens of steps late under load; async saves every 7 steps.
JOB = ["model.hidden_sizes=[512,512]", "trainer.epochs=10", "checkpoint.every_steps=7", "checkpoint.every_minutes=null"]
# The same for a user's task from a package outside the toolkit (tests/fixtures/mytasks) that
# draws random numbers in its data set's __getitem__ (on the workers) and in its step (per rank)
USER_JOB = [
    "task._target_=mytasks.noisy.Noisy",
    "+task.hidden=512",
    "+task.samples=8192",
    "data.batch_size=128",
    "optim=adamw",
    "trainer.epochs=3",  # 96 steps: the stop lands after step 5, even tens of steps late
    "checkpoint.every_steps=7",
    "checkpoint.every_minutes=null",
    "data.workers=2",  # its items are pickled back from worker processes
]


# The built-in task: the verifier's matrix (tests/mpi/test_verify.py: converted shards, workers,
# augmentation; BatchNorm; ZeRO-2; the LM task), the prefetch thread's batches equal the workers'
# bit for bit (tests/unit/test_fit_in_process.py), and the real preemption on Slurm resumes it.
# Sharded state (comm.sharding) stopped and resumed on real ranks: tests/mpi/test_run_handle.py
# (ZeRO-2 on mpirun, a script's FSDP2 under launch.py), tests/mpi/test_world_size_change.py (the
# built-in loop's FSDP2, 2 -> 3 -> 2 ranks) and tests/e2e/test_preemption.py (ZeRO-2 on Slurm).
# The user's task keeps its checkpoints in an object store (checkpoint.uri: a real S3-compatible
# server, scripts/s3-sim.sh), the verifier's runs in the run dir: the same guarantees from both.
def test_signal_stops_resume_bit_exactly(tmp_path, s3):
    job = [*USER_JOB, f"checkpoint.uri={s3}"]  # the server's variables set for the ranks
    env = fixtures_env()
    (tmp_path / "a").mkdir()
    reference = run_launch(*job, cwd=tmp_path / "a", env=env)
    assert reference.returncode == 0, reference.stderr
    (ref_dir,) = run_dirs(tmp_path / "a")

    (tmp_path / "b").mkdir()
    # Prepare the run dir through launch.py, then interrupt its ranks: start it with a signal
    # arriving after a few steps, resume from command.txt, twice, then let it finish.
    first = start_launch(*job, cwd=tmp_path / "b", env=env)
    run_dir = wait_for_run(first, tmp_path / "b", lambda run: logged_steps(run) >= 5, "5 steps", timeout_s=120)
    # The first stop: SIGUSR2 (submitit's) to one rank only; the step's vote stops every rank at the same step
    os.kill(max(rank_pids(run_dir)), signal.SIGUSR2)
    assert first.wait(timeout=120) == EXIT_RESUMABLE  # outside Slurm: start the same run dir again
    launched = (run_dir / "launch.log").read_text()  # the launcher's own lines, timed (it was always empty: issue 45)
    assert "2 ranks on this machine" in launched and f"the ranks exited with code {EXIT_RESUMABLE}" in launched and "to resume: bash" in launched
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "stopped" and result["exit_code"] == EXIT_RESUMABLE and result["finished"] is False
    stopped = result["steps"]

    # One stop each: repeated resumes of one run dir are tests/e2e/test_preemption.py's (four), and
    # every further stop here costs a start of every rank (30-40 s on the test machine); SIGTERM
    # stops tests/mpi/test_world_size_change.py's runs.
    command, env = resume_command(run_dir)
    final = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["resumed_from"] == stopped and result["finished"] is True
    assert "accuracy" not in result["val_metrics"]  # the task's own metrics only: a regression has no accuracy

    assert 0 < stopped < result["steps"]
    store = stored_checkpoints(run_dir / "checkpoints")  # resumed from the object store: the run dir holds none of it
    assert isinstance(store, ObjectStore) and store.committed_steps()[-1] == result["steps"]
    assert not list((run_dir / "checkpoints").rglob("*.ckpt")) and not list((run_dir / "checkpoints").glob("step-*"))
    assert step_losses(run_dir) == step_losses(ref_dir)  # every step, bit for bit
    assert state_hash(run_dir) == state_hash(ref_dir)
    ref_metrics = [json.loads(line) for line in (ref_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def strip(rows: list[dict]) -> list[tuple]:
        return [(m["epoch"], m["step"], m["loss"], *(v for k, v in sorted(m.items()) if k.startswith("val_"))) for m in rows]

    assert strip(metrics) == strip(ref_metrics)
    # the random streams too: each batch's, read on the workers, and each rank's own
    draws = [{k: v for k, v in row.items() if k.endswith(("_noise", "_draw"))} for row in logged_rows(run_dir)]
    assert draws == [{k: v for k, v in row.items() if k.endswith(("_noise", "_draw"))} for row in logged_rows(ref_dir)]
    assert all(row["rank0_draw"] != row["rank1_draw"] for row in draws)  # every rank its own stream


def logged_rows(run_dir: Path) -> list[dict]:
    """steps.jsonl's last record of each step (steps re-run after a stop log again)."""
    rows = {row["step"]: row for row in map(json.loads, (run_dir / "steps.jsonl").read_text().splitlines())}
    return [rows[step] for step in sorted(rows)]


def test_resuming_with_another_model_fails_in_one_clear_line(tmp_path):
    first = run_launch("trainer.epochs=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (run_dir,) = run_dirs(tmp_path)
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("- 256\n", "- 64\n").replace("epochs: 1", "epochs: 2"))
    command, env = resume_command(run_dir)
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 1  # the failing rank's MPI_Abort(1), passed on by mpirun
    log = (run_dir / "logs" / "rank-00000.log").read_text()
    assert "error: checkpoint step 22 does not fit this model: 1.bias is (256,) there and (64,) here" in log
    assert "Traceback" not in log and "need not repeat" not in log  # it would repeat: no restart (hpc.rank.failures)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000000022"]  # intact
