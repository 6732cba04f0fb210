from datetime import datetime

import pytest

from hpc.env import slurm_job_id
from hpc.rank.lifecycle import EXIT_RESUMABLE, plan_after_stop, stop_reason
from hpc.slurmctl import parse_job_fields

NOW = datetime(2026, 11, 23, 12, 0, 0)


def fields(**kw):
    base = {"JobState": "RUNNING", "PreemptTime": "None", "EndTime": "2026-11-23T14:00:00"}
    return {**base, **kw}


def test_scontrol_one_line_output_parses():
    text = "JobId=42 JobName=train JobState=RUNNING Reason=None Restarts=2 PreemptTime=None EndTime=2026-11-23T14:00:00 Command=/x/y a=b"
    parsed = parse_job_fields(text)
    assert parsed["JobState"] == "RUNNING" and parsed["Restarts"] == "2" and parsed["EndTime"] == "2026-11-23T14:00:00"


@pytest.mark.parametrize(
    "job, reason",
    [
        (fields(PreemptTime="2026-11-23T11:59:50"), "preemption"),
        (fields(EndTime="2026-11-23T12:01:30"), "time limit"),  # within signal_seconds (60) + 30 s
        (fields(EndTime="2026-11-23T12:05:00"), "external signal"),
        (fields(EndTime="Unknown"), "external signal"),
        (fields(JobState="REQUEUE_FED"), "requeue in progress"),
        (fields(JobState="COMPLETING", Restarts="1"), "requeue in progress"),  # scontrol requeue counts at once
        (fields(JobState="COMPLETING", Restarts="0"), "cancelled"),  # scancel: no restart counted
        (fields(JobState="COMPLETING", Restarts="0", PreemptTime="2026-11-23T11:59:50"), "requeue in progress"),
    ],
)
def test_stop_reason_comes_from_slurm_facts(job, reason):
    assert stop_reason(job, NOW, signal_seconds=60) == reason


def test_a_job_ending_is_told_requeued_or_cancelled_against_this_starts_restart_count():
    assert stop_reason(fields(JobState="COMPLETING", Restarts="2"), NOW, 60, restart_count=2) == "cancelled"
    assert stop_reason(fields(JobState="COMPLETING", Restarts="3"), NOW, 60, restart_count=2) == "requeue in progress"


def test_array_tasks_requeue_by_array_id():
    assert slurm_job_id({"SLURM_JOB_ID": "101", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "3"}) == "100_3"
    assert slurm_job_id({"SLURM_JOB_ID": "101"}) == "101"


def test_outside_slurm_or_without_scontrol_exits_resumable(monkeypatch):
    what, job_id, code = plan_after_stop({}, NOW, 60)
    assert (job_id, code) == (None, EXIT_RESUMABLE) and "not a Slurm job" in what
    monkeypatch.setattr("shutil.which", lambda name: None)
    what, job_id, code = plan_after_stop({"SLURM_JOB_ID": "7"}, NOW, 60)
    assert (job_id, code) == (None, EXIT_RESUMABLE) and "scontrol not found" in what


def run_exit_trap(tmp_path, finished: bool, rc: int):  # type: ignore[no-untyped-def]
    """The batch script's EXIT trap in a real bash, after a step that exited `rc`, with a fake
    scontrol that says the job runs and records what it is asked."""
    import subprocess

    from hpc.submit.slurm import exit_trap_lines

    bin_dir, requests = tmp_path / "bin", tmp_path / "requests"
    bin_dir.mkdir(parents=True)
    requests.mkdir()
    calls = tmp_path / "scontrol.calls"
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n[ "$1" = show ] && echo "JobId=7 JobState=RUNNING Requeue=1 Restarts=0"\nexit 0\n')
    fake.chmod(0o755)
    if finished:
        (requests / "7.finished").touch()
    script = "\n".join([*exit_trap_lines(3), f"(exit {rc})"])
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "HPCTK_REQUEUE_DIR": str(requests)}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    return done, calls.read_text() if calls.exists() else ""


def test_a_finished_training_ends_its_job_completed_even_when_a_late_kill_ends_the_step(tmp_path):
    done, calls = run_exit_trap(tmp_path / "finished", finished=True, rc=143)
    assert done.returncode == 0 and "requeue" not in calls and "training completed" in done.stderr
    # The control: the same exit without the finished mark is a failure, requeued within the budget.
    done, calls = run_exit_trap(tmp_path / "died", finished=False, rc=137)
    assert done.returncode == 137 and "requeue 7" in calls and "a rank died (srun exit 137)" in done.stderr
