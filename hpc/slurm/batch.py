"""Slurm through submitit's public API: sbatch parameters, the exact script, submission, job state.

The dry run prints the very text submitit writes at submission: it is a submission, to an
`sbatch` that accepts it and runs nothing (render_sbatch).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hpc.config.schema import JobConfig
from hpc.env import (
    ALLOCATION_RESTARTS_VARIABLE,
    BATCH_STARTED_VARIABLE,
    REQUEST_DIR_VARIABLE,
    STEP_NODES_VARIABLE,
    WARM_DIR_VARIABLE,
    WARM_GPUS_VARIABLE,
    WARM_RANKS_VARIABLE,
    WARM_VARIABLE,
)
from hpc.errors import UserError
from hpc.launching.follow import Follower
from hpc.rank.main import EXIT_RESUMABLE
from hpc.rundir import PROJECT_ROOT, RunDir
from hpc.slurm import slurmctl
from hpc.slurm.options import dependency, sbatch_lines
from hpc.slurm.warmnodes import END_CALL as WARM_END_CALL
from hpc.slurm.warmnodes import batch_start_lines, warm_program

SUBMITTED_SCRIPT_GLOB = "*_submission.sh"  # where submitit (1.5.0 and later) keeps the script it gave sbatch: <job id>_submission.sh
UNKNOWN_POLLS = 5  # consecutive squeue answers of UNKNOWN (forgotten, or squeue failing) that end wait_for_job


def setup_lines(env: dict[str, str], code_root: Path = PROJECT_ROOT) -> list[str]:
    """Shell lines exporting `env` and PYTHONPATH (`code_root` first); every value is quoted,
    never executed, and a name that is not a shell variable is refused."""
    bad = sorted(key for key in env if not key.isidentifier())
    if bad:
        raise UserError(f"cluster.env has names that are not shell variables: {', '.join(bad)}")
    lines = [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
    lines.append(f"export PYTHONPATH={shlex.quote(str(code_root))}${{PYTHONPATH:+:$PYTHONPATH}}")
    return lines


def job_setup_lines(
    env: dict[str, str], code_root: Path, step_nodes: int = 1, allocation_restarts: int = 0, warm_ranks: bool = True, node_gpus: int = 0
) -> list[str]:
    """What the sbatch script runs before srun. Two lines make the frozen code the code that runs:
    PYTHONSAFEPATH keeps `python -m` from importing the live checkout through the working
    directory, and SLURM_EXPORT_ENV=ALL makes srun hand these exports to the ranks even on
    clusters whose sbatch defaults to --export=NONE (which srun would otherwise inherit). Rank 0
    leaves requeue requests for the EXIT trap in <run or sweep dir>/slurm/requeue-requests; the
    step supervisor (hpc.slurm.supervise) reads the exports after it."""
    requests = code_root.parent / "slurm" / "requeue-requests"
    return [
        f"export {BATCH_STARTED_VARIABLE}=${{EPOCHREALTIME:-$(date +%s.%N)}}  # first: the cost of an interruption counts from here",
        f"unset {WARM_VARIABLE} {WARM_DIR_VARIABLE}  # an enclosing job's (submitted from inside one): this job's come below",
        *setup_lines(env, code_root),
        "export PYTHONSAFEPATH=1",
        "export SLURM_EXPORT_ENV=ALL",
        f"export {REQUEST_DIR_VARIABLE}={shlex.quote(str(requests))}",
        f"export {STEP_NODES_VARIABLE}={int(step_nodes)}",
        f"export {ALLOCATION_RESTARTS_VARIABLE}={int(allocation_restarts)}",
        f"export {WARM_RANKS_VARIABLE}={int(warm_ranks)}",
        *([f"export {WARM_GPUS_VARIABLE}={int(node_gpus)}"] if warm_ranks and node_gpus else []),
    ]


def requeue_function_lines() -> list[str]:
    """`hpctk_requeue ID CODE`: `scontrol requeue`, tried again while it fails and the job still
    runs and allows a requeue, as hpc.slurm.slurmctl.requeue does: a busy or restarting slurmctld
    times out RPCs ("Socket timed out on send/recv operation"), and a requeue lost to one left
    a stopped run ended for good, as COMPLETED. A try that timed out may still go through once
    slurmctld reads it: a restart count above this start's is success. One that never goes
    through ends the job with exit code CODE (75, resumable, after a stop): FAILED, with the
    line that says so."""
    tries, backoff_s, deadline_s, call_s = slurmctl.REQUEUE_TRIES, slurmctl.REQUEUE_BACKOFF_S, slurmctl.REQUEUE_DEADLINE_S, slurmctl.SCONTROL_TIMEOUT_S
    return [
        "hpctk_requeue() {  # ID, exit code if it never goes through",
        "    local id=$1 try out began=$SECONDS",
        f"    for (( try = 1; try <= {tries}; try++ )); do",
        f'        out=$(timeout {call_s} scontrol requeue "$id" 2>&1) && return 0',
        f"        echo \"hpc-toolkit: scontrol requeue $id failed (try $try of {tries}): $(printf %s \"$out\" | tr '\\n' ' ')\" >&2",
        f'        if out=$(timeout {call_s} scontrol show job -o "$id" 2>&1); then  # Slurm answers again',
        "            # A try that timed out was still queued at slurmctld, and went through once it answered",
        "            [[ $out =~ Restarts=([0-9]+) ]] && (( 10#${BASH_REMATCH[1]} > ${SLURM_RESTART_COUNT:-0} )) && return 0",
        "            [[ $out =~ JobState=RUNNING( |$) && ! $out =~ Requeue=0( |$) ]] || break  # cancelled, ending, or not requeueable",
        "        fi",
        f"        (( try < {tries} && SECONDS - began < {deadline_s} )) || break",
        f"        sleep $(( try * {backoff_s} ))",
        "    done",
        '    echo "hpc-toolkit: job $id was not requeued: the run stays stopped at its last committed checkpoint;'
        ' requeue the job (scontrol requeue $id) or start the run again to resume it" >&2',
        '    exit "$2"',
        "}",
    ]


def exit_trap_lines(max_failure_requeues: int) -> list[str]:
    """The batch script's EXIT trap, run once srun has returned. Files in $HPCTK_REQUEUE_DIR, named
    after the job (array task) id, carry what the ranks know across the job's starts:

    - `<id>.finished`: rank 0 completed the training. Never requeue, whatever srun returned
      (a rank that died while exiting must not start a finished run again), and exit 0: a kill
      Slurm still had queued for an earlier start may end the step after training completed,
      and the job must then read COMPLETED, not FAILED.
    - `<id>.restart-<SLURM_RESTART_COUNT>`: the ranks stopped cleanly and rank 0 asked for a
      requeue in this start (one left by an earlier start that never reached its trap cannot
      requeue a later one): requeue now. From here, not from a rank: requeueing a running step
      makes Slurm kill its tasks, and srun would report a clean stop as "Terminated".
    - `<id>.requeued-<SLURM_RESTART_COUNT>`: when this trap requeued the job (Unix time), for
      the cost of the interruption (hpc.rank.timeline).
    - `<id>.failures`: how many times this trap requeued the job after a rank died (killed, OOM,
      a lost node) while the job still runs, so that it resumes from its last committed
      checkpoint; at most `max_failure_requeues` (0: never). Preemptions and time limits do not
      count: SLURM_RESTART_COUNT counts every requeue, this file only failures (a script that
      exports no such directory falls back to SLURM_RESTART_COUNT). Not after a cancel or time
      limit (the job is no longer RUNNING), not when the ranks requeued it themselves
      (watchdog), and not after a Python error: the failing rank sets Requeue=0 first, since it
      would fail the same way again. Both requeues go through requeue_function_lines. First,
      the warm steps' FIFO is closed (hpc.slurm.warmnodes.batch_start_lines)."""
    return [
        *requeue_function_lines(),
        "hpctk_on_exit() {",
        "    local rc=$? id=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}",
        f"    {WARM_END_CALL}  # the warm steps end (hpc.slurm.warmnodes)",
        "    id=${id:-$SLURM_JOB_ID}",
        f'    local dir="${REQUEST_DIR_VARIABLE}" failures=${{SLURM_RESTART_COUNT:-0}}  # no directory: every restart counts',
        '    local request="$dir/$id.restart-${SLURM_RESTART_COUNT:-0}"',
        "    if [[ -n $dir ]]; then",
        "        failures=0",
        '        [[ -f "$dir/$id.failures" ]] && failures=$(< "$dir/$id.failures")',
        "    fi",
        "    [[ $failures =~ ^[0-9]+$ ]] || failures=0",
        '    if [[ -f "$dir/$id.finished" ]]; then  # training completed: so does the job, whatever the step did after',
        '        rm -f "$request"',
        '        (( rc == 0 )) || echo "hpc-toolkit: training completed; the step then ended with exit $rc (a late kill): job $id completed" >&2',
        "        exit 0",
        '    elif [[ -f "$request" ]]; then',
        '        echo "hpc-toolkit: the ranks $(cat "$request") and have exited: requeueing job $id" >&2',
        '        rm -f "$request"',
        '        date +%s.%N > "$dir/$id.requeued-${SLURM_RESTART_COUNT:-0}"',
        f'        hpctk_requeue "$id" {EXIT_RESUMABLE}',
        f"    elif (( rc != 0 && failures < {int(max_failure_requeues)} )) &&",
        '        scontrol show job -o "$id" | grep -q "JobState=RUNNING .*Requeue=1 "; then',
        '        [[ -n $dir ]] && mkdir -p "$dir" && echo $(( failures + 1 )) > "$dir/$id.failures"',
        f'        echo "hpc-toolkit: a rank died (srun exit $rc): requeueing job $id to resume from its last committed checkpoint'
        f' (failure requeue $(( failures + 1 )) of {int(max_failure_requeues)})" >&2',
        '        [[ -n $dir ]] && date +%s.%N > "$dir/$id.requeued-${SLURM_RESTART_COUNT:-0}"',
        '        hpctk_requeue "$id" "$rc"',
        "    fi",
        "}",
        "trap hpctk_on_exit EXIT",
        # `scancel --signal=USR1 --full` signals this shell too, which USR1 would end (the job
        # then FAILED, never requeued): the ranks stop and save, the shell lives on to requeue.
        "trap : USR1 USR2",
    ]


def sbatch_parameters(job: JobConfig, env: dict[str, str], code_root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """submitit's parameters. submitit writes no srun line of its own (use_srun=False): the
    function it runs in the batch step is the step supervisor, running srun with `srun_args`
    (srun_line)."""
    res, cluster = job.resources, job.cluster
    setup = job_setup_lines(env, code_root, res.nodes, cluster.allocation_restarts, cluster.warm_ranks, res.tasks_per_node * res.gpus_per_task)
    setup += exit_trap_lines(cluster.failure_requeues if cluster.requeue else 0)
    srun_args = list(cluster.srun_args)
    if res.spare_nodes:  # the step runs on `nodes` of the nodes + spares allocated
        srun_args = [f"--nodes={res.nodes}", f"--ntasks={res.nodes * res.tasks_per_node}", f"--ntasks-per-node={res.tasks_per_node}", *srun_args]
    container, rank_python = container_launch(job, code_root.parent)
    srun_args += container
    program = warm_program(["srun", *rank_python, "-u", "-m", "hpc.rank.main"])
    warm_lines = batch_start_lines(program, res.tasks_per_node * res.gpus_per_task) if cluster.warm_ranks and program and not container else []
    params: dict[str, Any] = {
        "rank_python": rank_python,  # hpc.slurm.batch's own: taken out before submitit sees the rest
        "job_name": job.name,
        "nodes": res.nodes + res.spare_nodes,
        "ntasks_per_node": res.tasks_per_node,
        "cpus_per_task": res.cpus_per_task,
        "time": res.time_min if res.time_min is not None else cluster.time_min,
        "srun_args": srun_args,
        "use_srun": False,
        "setup": setup + list(cluster.setup) + warm_lines,  # the warm steps in the environment the user's lines made
        "stderr_to_stdout": False,
        # Every rank gets the signal (no "B:"); the ranks agree on a step, save and requeue.
        "additional_parameters": {"signal": f"{cluster.signal}@{cluster.signal_seconds}", **({"requeue": True} if cluster.requeue else {})},
    }
    if res.spare_nodes:  # a lost node leaves the allocation instead of ending the job
        params["additional_parameters"]["no-kill"] = True
    optional = {"partition": cluster.partition, "account": cluster.account, "qos": cluster.qos, "constraint": cluster.constraint}
    params.update({key: value for key, value in optional.items() if value})
    if cluster.mem_gb:
        params["mem"] = f"{int(cluster.mem_gb * 1024)}MB"
    if res.gpus_per_task:
        params["gpus_per_task"] = res.gpus_per_task
    if cluster.switches is not None:
        params["additional_parameters"]["switches"] = f"{cluster.switches}@{cluster.switches_wait_min}"
    if job.hold:
        params["additional_parameters"]["hold"] = True
    needs = dependency(job.after, job.after_any)
    if needs:
        params["additional_parameters"]["dependency"] = needs
    params["additional_parameters"].update(sbatch_lines(cluster.sbatch))  # checked on the login node: none of the above
    return params


def container_launch(job: JobConfig, shared_dir: Path) -> tuple[list[str], list[str]]:
    """(srun's container options, the command that starts the ranks' Python) for
    cluster.container: pyxis's srun options with the image's `python3`, or `apptainer exec`
    around it; without a container, none and this interpreter. `shared_dir` (the run or sweep
    dir: frozen code, configs, logs, checkpoints) is mounted at its own path."""
    cluster = job.cluster
    if not cluster.container:
        return [], [sys.executable]
    mounts = [f"{shared_dir}:{shared_dir}", *cluster.container_mounts]
    if cluster.container_runtime == "pyxis":
        return [f"--container-image={cluster.container}", f"--container-mounts={','.join(mounts)}"], ["python3"]
    binds = [arg for mount in mounts for arg in ("--bind", mount)]
    return [], ["apptainer", "exec", *(["--nv"] if job.resources.gpus_per_task else []), *binds, cluster.container, "python3"]


def srun_line(folder: Path, srun_args: list[str], run_dir: Path, array: bool = False, python: Sequence[str] = ()) -> list[str]:
    """The ranks' step: srun running `python -m hpc.rank.main RUN_DIR` on every task (its first
    module catches the stop signals before anything is imported). The per-task logs are named
    as submitit names them."""
    from submitit.core.utils import JobPaths

    paths = JobPaths(folder=folder)
    stdout, stderr = str(paths.stdout), str(paths.stderr)
    if array:
        stdout, stderr = stdout.replace("%j", "%A_%a"), stderr.replace("%j", "%A_%a")
    return ["srun", "--unbuffered", "--output", stdout, "--error", stderr, *srun_args, *(python or [sys.executable]), "-u", "-m", "hpc.rank.main", str(run_dir)]


def submit_array(params: dict[str, Any], run_dirs: list[RunDir], folder: Path, max_parallel: int | None = None) -> tuple[list[str], str]:
    """One sbatch for all `run_dirs` (a job array when there are several: `--array=0-N%max_parallel`).
    Returns the job ids ("123" or "123_0", "123_1", ...) and the submitted script.

    Through submitit's public API only: its parameters (`setup` before the command, use_srun=False),
    and the function it runs in the batch step: hpc.slurm.supervise.supervise_step, the step
    supervisor running the ranks' srun line (srun_line) with the run dir of its array task."""
    import submitit

    scripts_before = set(folder.rglob(SUBMITTED_SCRIPT_GLOB)) if folder.exists() else set()
    try:
        with _quiet_stderr_fd():  # sbatch's own error lines would repeat the one we print
            submitted = _submit(params, run_dirs, folder, max_parallel)
    except (subprocess.CalledProcessError, submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as err:
        lines = [line.removeprefix("sbatch: error: ") for line in str(err).splitlines() if line.strip()]
        known = slurmctl.partitions() if "invalid partition" in str(err).lower() else []
        choices = f" (cluster.partition; this cluster's partitions: {', '.join(known)})" if known else ""
        raise UserError(f"sbatch refused the job: {'; '.join(lines)}{choices}") from None
    if len(run_dirs) == 1:
        script = submitted[0].paths.submission_file
    else:  # an array's script: under the array's own job id, not a task's
        (script,) = {path for path in folder.rglob(SUBMITTED_SCRIPT_GLOB) if not path.is_symlink()} - scripts_before
    return [str(job.job_id) for job in submitted], script.read_text()


def _submit(params: dict[str, Any], run_dirs: list[RunDir], folder: Path, max_parallel: int | None) -> list[Any]:
    import submitit

    from hpc.slurm.supervise import supervise_step

    executor = submitit.SlurmExecutor(folder=folder / "%j", python=shlex.quote(sys.executable))
    array = len(run_dirs) > 1
    params = dict(params)
    python = params.pop("rank_python", None) or [sys.executable]
    lines = [srun_line(executor.folder, params["srun_args"], run_dir.path, array, python) for run_dir in run_dirs]
    # The srun line travels in submitit's pickle; the script shows it too, for whoever reads it, as
    # comments (a line break in a path is shown escaped: it would end the comment)
    shown = shlex.join([*lines[0][:-1], "RUN_DIR"]) if array else shlex.join(lines[0])
    note = ["# the ranks' step, started by the step supervisor (hpc.slurm.supervise) that submitit runs below:", f"#   {shown}"]
    if array:
        note.append(f"#   RUN_DIR: the array task's point dir, {shlex.quote(str(run_dirs[0].path.parent))}/<point number>")
    note = [line.replace("\n", "\\n").replace("\r", "\\r") for line in note]
    executor.update_parameters(**{**params, "setup": [*params["setup"], *note]}, array_parallelism=max_parallel or len(run_dirs))
    if not array:
        return [executor.submit(supervise_step, lines[0])]
    return list(executor.map_array(supervise_step, lines))


def render_sbatch(job: JobConfig, env: dict[str, str], run_dir: RunDir) -> str:
    """The script `submit` would give sbatch (dry_run=true), written by submitit itself: a
    submission to an `sbatch` that accepts it without running anything. It leaves nothing in
    the run dir."""
    return render_array_sbatch(sbatch_parameters(job, env, run_dir.code), run_dir.submitit, [run_dir])


def render_array_sbatch(params: dict[str, Any], folder: Path, run_dirs: list[RunDir]) -> str:
    """The script of one sbatch for `run_dirs` (a job array when several), as submit_array would
    submit it; `folder` is removed again where this made it."""
    made = next((path for path in reversed([folder, *folder.parents]) if not path.exists()), None)  # the first folder submitit will make
    try:
        with _sbatch_accepting_anything():
            limit = params.get("array_parallelism")
            return submit_array({k: v for k, v in params.items() if k != "array_parallelism"}, run_dirs, folder, limit)[1]
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


@contextlib.contextmanager
def _sbatch_accepting_anything() -> Iterator[None]:
    """PATH with an `sbatch` first that answers every submission with job id 0 (submitit runs
    the `sbatch` on PATH; a dry run is a submission that goes nowhere)."""
    with tempfile.TemporaryDirectory(prefix="hpctk-dry-sbatch-") as stub_dir:
        stub = Path(stub_dir) / "sbatch"
        stub.write_text("#!/bin/sh\necho 'Submitted batch job 0'\n")
        stub.chmod(0o755)
        before = os.environ.get("PATH", "")
        os.environ["PATH"] = f"{stub_dir}{os.pathsep}{before}"
        try:
            yield
        finally:
            os.environ["PATH"] = before


def submit(job: JobConfig, env: dict[str, str], run_dir: RunDir, code_root: Path) -> str:
    """Submit the job's ranks (hpc.rank.main RUN_DIR under the step supervisor); the Slurm job id."""
    job_ids, script = submit_array(sbatch_parameters(job, env, code_root), [run_dir], run_dir.submitit)
    run_dir.sbatch.write_text(script)
    return job_ids[0]


@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """Send file descriptor 2 (inherited by the sbatch child) to /dev/null for a moment."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def rank0_console(folder: Path, job_id: str) -> tuple[Path, Path]:
    """Rank 0's stdout and stderr files under submitit's `folder` (the run dir's slurm/%j): what
    a local run shows on its console (the toolkit's lines and the script's own output). The
    batch step writes into the same stdout file (submitit's lines, which wait_for_job leaves out)."""
    from submitit.core.utils import JobPaths

    paths = JobPaths(folder=folder, job_id=job_id, task_id=0)
    return paths.stdout, paths.stderr


def waiting_reason(fields: dict[str, str], restarts: int) -> str:
    """Why a pending job waits (scontrol's Reason), and for Slurm's hold after a requeue until
    when; "" where Slurm gives none."""
    reason = fields.get("Reason", "")
    if reason in ("None", ""):
        return ""
    return (held_until(fields, restarts) or reason) if reason == "BeginTime" else reason


def held_until(fields: dict[str, str], restarts: int) -> str:
    """Why a job waits for its begin time, and until when: Slurm holds a requeued job back for
    about two minutes (`scontrol update jobid=J starttime=now` lifts it; `scontrol release` does
    not). "" where Slurm gave no time."""
    when = next((fields[k] for k in ("EligibleTime", "StartTime") if fields.get(k, "Unknown") not in ("Unknown", "None", "")), "")
    clock = when.rpartition("T")[2]
    if not clock:
        return ""
    return f"requeue hold to {clock}" if restarts else f"begins {clock}"


def wait_for_job(job_id: str, outputs: Sequence[Follower], poll_s: float = 1.0) -> str:
    """Block until the job ends, streaming what `outputs` follow (rank 0's stdout and stderr);
    returns the final state."""
    unknown = 0
    while True:
        state = slurmctl.job_state(job_id)
        ended = state in slurmctl.TERMINAL_STATES
        unknown = unknown + 1 if state == "UNKNOWN" else 0
        for follow in outputs:
            follow(flush=ended)
        if ended or unknown >= UNKNOWN_POLLS:  # one slow or failed squeue is not the end
            return state
        time.sleep(poll_s)  # polling squeue: the job's state has no push notification here
