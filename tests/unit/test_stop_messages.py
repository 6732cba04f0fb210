"""What a stop says and who requeues: every signal validation accepts is a stop, a stopped rank
never returns to submitit (which would log "Job completed successfully"), and the batch script's
EXIT trap, not a rank, requeues after a clean stop (so srun reports no "Terminated" tasks)."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import replace
from pathlib import Path

from hpc.config.schema import JobConfig
from hpc.config.validate import check_resources
from hpc.env import REQUEST_DIR_VARIABLE
from hpc.errors import UserError
from hpc.rank import main as rank_main
from hpc.slurm.batch import exit_trap_lines, job_setup_lines
from hpc.slurm.job import mark_finished, request_requeue


def accepted_signals() -> list[str]:
    job = JobConfig()
    accepted = []
    for sig in signal.Signals:
        try:
            check_resources(replace(job, cluster=replace(job.cluster, signal=sig.name.removeprefix("SIG"))))
        except UserError:
            continue
        accepted.append(sig.name)
    return accepted


def test_every_signal_validation_accepts_is_handled_as_a_stop():
    accepted = accepted_signals()
    assert "SIGINT" in accepted and "SIGUSR1" in accepted
    assert sorted(accepted) == sorted(sig.name for sig in rank_main.STOP_SIGNALS)


def run_trap(tmp_path: Path, env: dict[str, str], srun_exit: int, max_failure_requeues: int = 3) -> tuple[list[str], str]:
    """The EXIT trap in bash after an `srun` that exited with `srun_exit`, with a fake scontrol
    that reports the job RUNNING and records what it was asked; (scontrol calls, stderr)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    calls.unlink(missing_ok=True)
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {calls}\n[[ $1 == show ]] && echo "JobId=7 JobState=RUNNING Reason=None Requeue=1 Restarts=0"\nexit 0\n')
    fake.chmod(0o755)
    script = "\n".join([*exit_trap_lines(max_failure_requeues), f"exit {srun_exit}"])
    done = subprocess.run(["bash", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=30)
    return (calls.read_text().splitlines() if calls.exists() else []), done.stderr


def test_the_batch_script_requeues_after_a_clean_stop_once_srun_returned(tmp_path):
    requests = tmp_path / "requests"
    env = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2", REQUEST_DIR_VARIABLE: str(requests)}
    request = request_requeue(env, "7", "stopped by SIGUSR1 at step 12, checkpoint committed")
    assert request == requests / "7.restart-2"
    calls, stderr = run_trap(tmp_path, env, srun_exit=0)
    assert calls == ["requeue 7"]
    assert "hpc-toolkit: the ranks stopped by SIGUSR1 at step 12, checkpoint committed and have exited: requeueing job 7" in stderr
    assert not request.exists()
    # A request an earlier start left behind (its trap never ran) does not requeue this one.
    request_requeue({**env, "SLURM_RESTART_COUNT": "1"}, "7", "stopped by SIGTERM at step 3, checkpoint committed")
    assert run_trap(tmp_path, env, srun_exit=0) == ([], "")


def test_the_request_names_the_array_task_and_without_the_trap_there_is_none(tmp_path):
    env = {"SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "4", REQUEST_DIR_VARIABLE: str(tmp_path)}
    assert request_requeue(env, "9_4", "stopped") == tmp_path / "9_4.restart-0"
    calls, _ = run_trap(tmp_path, env, srun_exit=0)
    assert calls == ["requeue 9_4"]
    assert request_requeue({"SLURM_JOB_ID": "7"}, "7", "stopped") is None  # a hand-typed sbatch: rank 0 requeues


def test_a_dead_rank_still_requeues_at_most_failure_requeues_times(tmp_path):
    """Without a request directory (a script that exports none), every restart counts, as before."""
    calls, stderr = run_trap(tmp_path, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}, srun_exit=137)
    assert calls == ["show job -o 7", "requeue 7"] and "a rank died (srun exit 137)" in stderr
    assert run_trap(tmp_path, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "3"}, srun_exit=137)[0] == []
    assert run_trap(tmp_path, {"SLURM_JOB_ID": "7"}, srun_exit=137, max_failure_requeues=0)[0] == []


def test_the_failure_budget_counts_failures_not_preemptions(tmp_path):
    """Five requeues by preemption (SLURM_RESTART_COUNT=5) leave a budget of 2 failures intact:
    the trap counts its own failure requeues in the request directory."""
    requests = tmp_path / "requests"
    env = {"SLURM_JOB_ID": "7", REQUEST_DIR_VARIABLE: str(requests)}
    calls, stderr = run_trap(tmp_path, {**env, "SLURM_RESTART_COUNT": "5"}, srun_exit=137, max_failure_requeues=2)
    assert calls == ["show job -o 7", "requeue 7"] and "(failure requeue 1 of 2)" in stderr
    assert (requests / "7.failures").read_text().strip() == "1"
    assert run_trap(tmp_path, {**env, "SLURM_RESTART_COUNT": "6"}, srun_exit=137, max_failure_requeues=2)[0][-1] == "requeue 7"
    assert run_trap(tmp_path, {**env, "SLURM_RESTART_COUNT": "7"}, srun_exit=137, max_failure_requeues=2)[0] == []  # budget spent
    assert run_trap(tmp_path, {**env, "SLURM_RESTART_COUNT": "7"}, srun_exit=0)[0] == []  # a clean exit is no failure


def test_a_finished_training_is_never_requeued(tmp_path):
    requests = tmp_path / "requests"
    env = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "3", REQUEST_DIR_VARIABLE: str(requests)}
    assert mark_finished(env) == requests / "7.finished"
    assert run_trap(tmp_path, env, srun_exit=137)[0] == []  # a rank died while exiting a finished run
    request_requeue(env, "7", "stopped by SIGUSR1 at step 40, checkpoint committed")
    assert run_trap(tmp_path, env, srun_exit=0)[0] == [] and not (requests / "7.restart-3").exists()
    assert mark_finished({"SLURM_JOB_ID": "7"}) is None  # no batch script trap: nothing to tell


def test_the_request_directory_is_exported_to_the_ranks(tmp_path):
    lines = job_setup_lines({}, tmp_path / "run" / "code")
    assert f"export {REQUEST_DIR_VARIABLE}={tmp_path / 'run' / 'slurm' / 'requeue-requests'}" in lines
