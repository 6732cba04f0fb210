from datetime import datetime

import pytest

from hpc.rank.lifecycle import EXIT_RESUMABLE
from hpc.slurm.environment import slurm_job_id
from hpc.slurm.job import plan_after_stop, stop_reason
from hpc.slurm.slurmctl import parse_job_fields

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


def run_exit_trap(
    tmp_path, finished: bool, rc: int, failed_requeues: int = 0, state: str = "RUNNING", requested: bool = False, restarts: int = 0, requeue_flag: int = 1
):  # type: ignore[no-untyped-def]  # noqa: E501
    """The batch script's EXIT trap in a real bash, after a step that exited `rc`, with a fake
    scontrol that says the job is in `state` after `restarts` restarts, fails its first
    `failed_requeues` requeues as a busy slurmctld does, and records what it is asked (and a fake
    sleep, what it waits);
    `requested`: the ranks stopped and asked for a requeue."""
    import subprocess

    from hpc.slurm.batch import exit_trap_lines

    bin_dir, requests = tmp_path / "bin", tmp_path / "requests"
    bin_dir.mkdir(parents=True)
    requests.mkdir()
    calls = tmp_path / "scontrol.calls"
    fake = bin_dir / "scontrol"
    fake.write_text(
        f'#!/bin/bash\necho "$*" >> {calls}\n[ "$1" = show ] && echo "JobId=7 JobState={state} Requeue={requeue_flag} Restarts={restarts} X=y" && exit 0\n'
        f'if [ "$1" = requeue ] && (( $(grep -c ^requeue {calls}) <= {failed_requeues} )); then\n'
        '    echo "scontrol: error: Socket timed out on send/recv operation" >&2; exit 1\nfi\nexit 0\n'
    )
    (bin_dir / "sleep").write_text(f'#!/bin/sh\necho "sleep $*" >> {calls}\n')
    for tool in ("scontrol", "sleep"):
        (bin_dir / tool).chmod(0o755)
    if finished:
        (requests / "7.finished").touch()
    if requested:
        (requests / "7.restart-0").write_text("stopped by SIGUSR1 at step 4")
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


def test_a_requeue_slurmctld_times_out_on_is_tried_again_until_it_goes_through(tmp_path):
    done, calls = run_exit_trap(tmp_path / "busy", finished=False, rc=0, failed_requeues=2, requested=True)
    assert done.returncode == 0 and calls.count("requeue 7") == 3 and "sleep 2\n" in calls and "sleep 4\n" in calls, calls
    assert "failed (try 2 of 5): scontrol: error: Socket timed out" in done.stderr and "not requeued" not in done.stderr
    # Never through: the job ends resumable (75, FAILED) saying how to resume, not COMPLETED.
    done, calls = run_exit_trap(tmp_path / "down", finished=False, rc=0, failed_requeues=99, requested=True)
    assert done.returncode == 75 and calls.count("requeue 7") == 5 and "requeue the job (scontrol requeue 7) or start the run again" in done.stderr, calls
    # A job Slurm will not requeue (sbatch --no-requeue) is not tried again either; a rank's death keeps srun's code.
    done, calls = run_exit_trap(tmp_path / "norequeue", finished=False, rc=0, failed_requeues=99, requested=True, requeue_flag=0)
    assert done.returncode == 75 and calls.count("requeue 7") == 1, calls
    done, calls = run_exit_trap(tmp_path / "died", finished=False, rc=137, failed_requeues=99)
    assert done.returncode == 137 and calls.count("requeue 7") == 5 and "a rank died (srun exit 137)" in done.stderr, calls
    # A job Slurm no longer runs (cancelled while its ranks stopped) is not tried again.
    done, calls = run_exit_trap(tmp_path / "cancelled", finished=False, rc=0, failed_requeues=99, state="CANCELLED", requested=True)
    assert done.returncode == 75 and calls.count("requeue 7") == 1 and "sleep" not in calls, calls
    # A try that timed out but went through once slurmctld read it (seen on the simulated
    # cluster: slurmctld stopped for 14 s, scontrol gave up after MessageTimeout, the job requeued at once after)
    done, calls = run_exit_trap(tmp_path / "late", finished=False, rc=0, failed_requeues=99, state="PENDING", requested=True, restarts=1)
    assert done.returncode == 0 and calls.count("requeue 7") == 1 and "not requeued" not in done.stderr, calls


def fake_scontrol(tmp_path, failed_requeues: int, state: str, restarts: int = 0, flags: str = "Requeue=1 BatchFlag=1"):  # type: ignore[no-untyped-def]
    """A scontrol on PATH that fails its first `failed_requeues` requeues (a busy slurmctld) and
    says the job is in `state`; the calls it got are in the file returned."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "scontrol"
    fake.write_text(
        f'#!/bin/bash\necho "$*" >> {calls}\n[ "$1" = show ] && echo "JobId=7 JobState={state} Restarts={restarts} {flags}" && exit 0\n'
        f'if [ "$1" = requeue ] && (( $(grep -c ^requeue {calls}) <= {failed_requeues} )); then echo "Socket timed out" >&2; exit 1; fi\n'
    )
    fake.chmod(0o755)
    return bin_dir, calls


@pytest.mark.parametrize(
    "failed, state, restarts, tries, waits, error",
    [
        (2, "RUNNING", 0, 3, [2, 4], None),
        (99, "RUNNING", 0, 5, [2, 4, 6, 8], "Socket timed out"),
        (99, "CANCELLED", 0, 1, [], "Socket timed out"),
        (99, "PENDING", 1, 1, [], None),  # timed out, but went through once slurmctld read it
        (99, "RUNNING BatchFlag=0", 0, 1, [], "Socket timed out"),  # srun under salloc: Slurm requeues batch jobs only
        (99, "RUNNING Requeue=0", 0, 1, [], "Socket timed out"),  # sbatch --no-requeue
    ],
)
def test_rank_zeros_own_requeue_is_tried_again_while_the_job_runs(tmp_path, monkeypatch, failed, state, restarts, tries, waits, error):
    """What a hand-written batch script's rank 0 does after a stop (hpc.rank.scheduler), as the trap does."""
    from hpc.slurm import slurmctl

    state, _, flag = state.partition(" ")
    bin_dir, calls = fake_scontrol(tmp_path, failed, state, restarts, flag or "Requeue=1 BatchFlag=1")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    slept: list[float] = []
    assert slurmctl.requeue("7", 0, sleep=slept.append) == error
    assert calls.read_text().count("requeue 7") == tries and slept == waits
