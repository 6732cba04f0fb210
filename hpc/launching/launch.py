"""From a composed config to a running job: validate, lay out the run dir, run or submit."""

from __future__ import annotations

import functools
import logging
import os
import shlex
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from collectives.backends import backend_of
from collectives.mpirun import huge_pages_environment, root_environment
from hpc.config.diskspace import space_warnings
from hpc.config.schema import JobConfig, task_target
from hpc.config.scripts import literal, parse_script, script_frameworks
from hpc.config.scriptvalues import job_ids
from hpc.config.validate import validate_job
from hpc.env import WARM_IMPORTS_VARIABLE
from hpc.errors import UserError
from hpc.launching.deaths import KILLED, tell_killed
from hpc.launching.launchers import QueuedLauncher, launcher_for
from hpc.launching.ranks import ENDED_AT_ONCE
from hpc.launching.snapshot import freeze_job_code
from hpc.rank.main import EXIT_RESUMABLE
from hpc.rundir import RUN_MARKER, RunDir, failure_line, mark_run_dir
from hpc.runroots import remember
from trainers.config import LM_TASK
from trainers.data.datasets import DatasetInfo


def resolved_yaml(job: JobConfig) -> str:
    """config.yaml: the job as the ranks read it back (a script's arguments verbatim)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(replace(job, script_args=[literal(arg) for arg in job.script_args])))


def rank_environment(job: JobConfig) -> dict[str, str]:
    """Variables every rank needs, on top of the cluster's own."""
    env = {"PYTHONUNBUFFERED": "1", **huge_pages_environment(os.environ)}
    if job.cluster.warm_ranks and (imports := warm_imports(job)):
        env[WARM_IMPORTS_VARIABLE] = ",".join(imports)  # imported once per node, before the ranks fork (cluster.env may say otherwise)
    if job.trainer.threads_per_rank is not None:  # else each rank counts the cores it owns (hpc.rank.binding.rank_threads)
        env["OMP_NUM_THREADS"] = str(job.trainer.threads_per_rank)
    env.update(job.cluster.env)
    env.update(root_environment())
    return env


def warm_imports(job: JobConfig) -> list[str]:
    """What each node's warm process imports for this job beyond a rank's own modules: the real
    torch._dynamo where the ranks will need it (a compile, DistributedDataParallel or Horovod, a
    script: most wrap their model in DDP), else its stand-in serves them (hpc.rank.dynamo); and
    the frameworks a script imports."""
    needs_dynamo = bool(job.script) or job.trainer.compile or backend_of(job.comm, job.resources.gpus_per_task).family != "engine"
    frameworks = script_frameworks(job.script, Path(job.workdir or os.getcwd())) if job.script else []
    return ["torch._dynamo"] * needs_dynamo + frameworks


def prepare(job: JobConfig) -> JobConfig:
    """Validate, and pin what ranks must not re-derive. A run root too small for the job's
    checkpoints is a warning line; a read-only one is refused (hpc.config.diskspace)."""
    info = validate_job(job)
    check_for_scheduler(job)
    check_waits(job)
    check_refusal(job)
    for line in space_warnings(job, info):
        print(line, file=sys.stderr, flush=True)
    return pin_inputs(job, info)


def check_for_scheduler(job: JobConfig) -> None:
    """The settings only the job's scheduler knows (Slurm's: cluster.sbatch), by its plugin (QueuedLauncher.check)."""
    launcher = launcher_for(job)
    if isinstance(launcher, QueuedLauncher):
        launcher.check(job)


def check_refusal(job: JobConfig) -> None:
    """What the job's scheduler itself cannot run (QueuedLauncher.refusal), in one line."""
    launcher = launcher_for(job)
    refused = launcher.refusal(job) if isinstance(launcher, QueuedLauncher) else None
    if refused:
        raise UserError(refused)


def check_waits(job: JobConfig) -> None:
    """after= and after_any= (their form checked already): jobs the job's scheduler knows, and
    none of after='s ended otherwise than succeeded, which would leave this job waiting for ever.
    Not asked where the scheduler's tools are not here (a dry run away from the cluster)."""
    launcher = launcher_for(job)
    if not isinstance(launcher, QueuedLauncher) or shutil.which(launcher.query_tool()) is None:
        return
    waits = {"after": job_ids("after", job.after, launcher.traits), "after_any": job_ids("after_any", job.after_any, launcher.traits)}
    scheduler = launcher.traits.scheduler
    for key, ids in waits.items():
        for job_id in ids:
            state = launcher.dependency_state(job_id)
            if state is None:
                raise UserError(f"{key}={job_id}: {scheduler} knows no job {job_id} (a typo, or it ended long enough ago to be forgotten)")
            if key == "after" and state in launcher.terminal_states and state not in launcher.succeeded_states:
                raise UserError(f"{key}={job_id}: job {job_id} ended {state}, so this job would never start; use after_any={job_id} to run it anyway")


def pin_inputs(job: JobConfig, info: DatasetInfo | None) -> JobConfig:
    """The built-in tasks' input files, made absolute (and the embedded ones built, once, here
    rather than by every rank at once): classify's data.path, lm's task.tokens."""
    if info is not None:
        files = info.files or (info.path,)  # a glob or a directory pinned to the shards it matched now
        job = replace(job, data=replace(job.data, path=str(Path(files[0])) if len(files) == 1 else [str(Path(f)) for f in files]))
    if job.script is not None:  # the ranks find the script where launch.py ran
        workdir = Path(job.workdir).resolve() if job.workdir else Path.cwd()
        script = parse_script(job.script, workdir)
        # A script file of the launch dir, no workdir= given: the ranks start in its frozen copy
        # (RUN/code/script), so that what it reads by relative path is the code it was frozen with
        starts_frozen = job.workdir is None and script.path is not None and script.path.parent == Path.cwd().resolve()
        job = replace(job, script=str(script.path) if script.path else job.script, workdir=None if starts_frozen else str(workdir))
    if task_target(job) == LM_TASK:
        from trainers.data.tokens import TokenDataError, resolve_token_path

        try:
            job = replace(job, task={**job.task, "tokens": str(resolve_token_path(job.task.get("tokens")))})
        except (TokenDataError, OSError) as err:
            raise UserError(str(err)) from None
    return job


def tell(line: str, console: bool = True) -> None:
    """A launcher line: on stdout as it is (scripts read it), and with its time in the run's
    launch.log (the file handlers of hydra.job_logging), which otherwise holds only log records."""
    if console:
        print(line, flush=True)
    record = logging.LogRecord("hpc.launch", logging.INFO, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def launch(job: JobConfig, run_dir: RunDir) -> int:
    """Run or submit `job`, as prepare() returned it (validated once, by hpc.app), from `run_dir`."""
    env = rank_environment(job)
    launcher = launcher_for(job)
    if job.dry_run:
        print("# resolved config")
        print(resolved_yaml(job))
        print(launcher.dry_run(job, env, run_dir))
        return 0
    record_run(job, run_dir)
    if isinstance(launcher, QueuedLauncher):
        return submit_and_tell(launcher, job, env, run_dir)
    ranks = job.resources.nodes * job.resources.tasks_per_node
    tell(f"{ranks} ranks on this machine (cluster={job.cluster.name}); the ranks' logs: {run_dir.path / 'logs'}", console=False)
    tell(f"run directory: {run_dir.path}")  # at the start as well: a long run's files can be looked at meanwhile
    code = launcher.run(job, env, run_dir)
    tell(f"the ranks exited with code {code}; command: {run_dir.path / 'command.txt'}", console=False)
    tell(f"run directory: {run_dir.path}")
    if code == KILLED:  # no rank could say why: the launcher does, from the kernel's log (hpc.launching.deaths)
        print(f"error: {tell_killed(run_dir)}", file=sys.stderr, flush=True)
    elif code != 0 and (failure := run_failure(run_dir)):  # a rank's error, whichever rank: rank 0's log alone reaches this terminal
        print(f"error: the run failed on {failure}", file=sys.stderr, flush=True)
        tell(f"the run failed on {failure}", console=False)
    if code == EXIT_RESUMABLE:
        tell(stopped_line(run_dir))
    elif code == ENDED_AT_ONCE:
        command = shlex.quote(str(run_dir.path / "command.txt"))
        tell(f"ended at once (a second Ctrl-C): the newest committed checkpoint stays the newest; to resume: bash {command}")
    return code


def record_run(job: JobConfig, run_dir: RunDir) -> None:
    """Before the ranks start or the job is submitted: the run dir marked as one, its run root
    remembered (hpc.status with no dir named finds it), and config.yaml, what the ranks read."""
    mark_run_dir(run_dir.path)  # a script's folder frozen later leaves it out (hpc.config.freezing)
    remember(Path(job.run_root))
    run_dir.config.write_text(resolved_yaml(job))


def stopped_line(run_dir: RunDir) -> str:
    """What a stopped local run leaves and how it goes on, as its result.json tells: a script
    without the run handle saved what it saved itself (nothing the toolkit knows of)."""
    command = f"bash {shlex.quote(str(run_dir.path / 'command.txt'))}"
    try:
        result = run_dir.read_json(run_dir.result)
    except (OSError, ValueError):
        result = {}
    if not isinstance(result, dict):
        result = {}
    if result.get("script") and not result.get("handle"):
        return f"stopped; to start the script again (it resumes from what it saved itself): {command}"
    if not result.get("steps"):
        return f"stopped before its first checkpoint; to start it again: {command}"
    return f"stopped with a committed checkpoint at step {result['steps']}; to resume: {command}"


def submit_and_tell(launcher: QueuedLauncher, job: JobConfig, env: dict[str, str], run_dir: RunDir) -> int:
    """Submit the job, say its id in the form after= takes, and (wait=true) follow it to its end."""
    job_id = submit_job(launcher, job, env, run_dir)
    tell(f"submitted job {job_id} to {job.cluster.name} (a job to run once it completes: after={job_id})")
    tell(f"run directory: {run_dir.path}")
    if not job.wait:
        return 0
    state = launcher.wait(job_id, run_dir, print, functools.partial(print, file=sys.stderr))  # rank 0's console, as a local run shows it
    tell(f"job {job_id} ended: {state}")
    return 0 if state in launcher.succeeded_states and run_dir.result.exists() else 1


def submit_job(launcher: QueuedLauncher, job: JobConfig, env: dict[str, str], run_dir: RunDir) -> str:
    """Submit the job with its code frozen; its id, also in job.json. Refused: nothing is left."""
    try:
        job_id = launcher.submit(job, env, run_dir, freeze_job_code(run_dir.code, job))
    except UserError:
        shutil.rmtree(run_dir.path, ignore_errors=True)  # nothing was submitted: leave nothing
        raise
    info = {"job_id": job_id, "cluster": job.cluster.name, "launcher": job.cluster.launcher, "run_dir": str(run_dir.path)}
    run_dir.write_json(run_dir.job, info)
    return job_id


def run_failure(run_dir: RunDir) -> str:
    """The failing rank and its error from result.json; empty where it says nothing of one, or
    where rank 0 told it on the console already (a refused write: hpc.rank.diskfaults)."""
    result = run_dir.read_result()
    return "" if result.get("told") else failure_line(result)


def discard_run_dir(run_dir: RunDir) -> None:
    """After a dry run or refused input, remove what Hydra and launch.py created; nothing else is there."""
    leftovers = {p.name for p in run_dir.path.iterdir()} if run_dir.path.is_dir() else set()
    ours = {".hydra", "launch.log", RUN_MARKER} | ({"config.yaml"} if RUN_MARKER in leftovers else set())  # config.yaml: launch.py's, beside its marker
    if leftovers <= ours:
        shutil.rmtree(run_dir.path, ignore_errors=True)
