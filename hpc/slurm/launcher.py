"""The Slurm plugin's launcher (hpc.schedulers): jobs and job arrays through sbatch (submitit),
their states from scontrol and accounting, cancel and signals through scancel."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc.config.launchers import traits
from hpc.config.schema import JobConfig
from hpc.launching.launchers import GONE, QueuedJob, QueuedLauncher
from hpc.rundir import RunDir
from hpc.slurm import batch as slurm
from hpc.slurm import slurmctl
from hpc.slurm.options import sbatch_lines


class SlurmLauncher(QueuedLauncher):
    traits = traits("slurm")
    terminal_states = frozenset(slurmctl.TERMINAL_STATES)
    waiting_states = frozenset(slurmctl.WAITING_STATES)
    running_states = frozenset({"RUNNING", "COMPLETING"})
    succeeded_states = frozenset({"COMPLETED"})

    def dry_run(self, job: JobConfig, env: dict[str, str], run_dir: RunDir) -> str:
        return f"# sbatch script\n{slurm.render_sbatch(job, env, run_dir)}"

    def submit(self, job: JobConfig, env: dict[str, str], run_dir: RunDir, code: Path) -> str:
        return slurm.submit(job, env, run_dir, code)

    def array_parameters(self, job: JobConfig, env: dict[str, str], code: Path) -> dict[str, Any]:
        return slurm.sbatch_parameters(job, env, code)

    def max_array_size(self) -> int | None:
        return slurmctl.max_array_size()

    def after_any(self, params: dict[str, Any], job_id: str) -> dict[str, Any]:
        extra = params["additional_parameters"]
        needs = ",".join(filter(None, [extra.get("dependency"), f"afterany:{job_id}"]))
        return {**params, "additional_parameters": {**extra, "dependency": needs}}

    def submit_array(self, params: dict[str, Any], run_dirs: list[RunDir], folder: Path, max_parallel: int | None) -> tuple[str, list[str], str]:
        job_ids, script = slurm.submit_array(params, run_dirs, folder, max_parallel)
        return job_ids[0].split("_")[0], job_ids, script  # a task's id: "<array>_<task>"

    def render_array(self, params: dict[str, Any], folder: Path, run_dirs: list[RunDir], max_parallel: int) -> str:
        return slurm.render_array_sbatch({**params, "array_parallelism": max_parallel}, folder, run_dirs)

    def jobs(self, job_ids: list[str]) -> dict[str, QueuedJob]:
        records = slurmctl.job_records(job_ids)
        accounting = slurmctl.accounting_states([i for i in job_ids if not slurmctl.record_of(records, i)])
        seen = {}
        for job_id in job_ids:
            fields = slurmctl.record_of(records, job_id)
            restarts = int(fields["Restarts"]) if fields.get("Restarts", "").isdigit() else 0
            state = fields.get("JobState") or accounting.get(job_id) or GONE
            seen[job_id] = QueuedJob(state, restarts, slurm.waiting_reason(fields, restarts) if state == "PENDING" else "")
        return seen

    def cancel(self, job_id: str) -> str | None:
        return slurmctl.cancel(job_id)

    def signal(self, job_id: str, name: str) -> str | None:
        if name == "KILL":
            return slurmctl.kill_tasks(job_id)
        return slurmctl.cancel(job_id, signal=name)  # every step's tasks, not the batch shell (its EXIT trap requeues)

    def wait(self, job_id: str, run_dir: RunDir, emit: Callable[[str], None] = print, emit_err: Callable[[str], None] = print) -> str:
        stdout, stderr = slurm.rank0_console(run_dir.submitit / "%j", job_id)
        return slurm.wait_for_job(job_id, [slurm.Follower(stdout, emit), slurm.Follower(stderr, emit_err)])

    def console(self, job_id: str, run_dir: RunDir) -> Path | None:
        return slurm.rank0_console(run_dir.submitit / "%j", job_id)[0]

    def query_tool(self) -> str:
        return "scontrol"  # jobs() and dependency_state() ask it (and sacct, where accounting runs)

    def stoppable(self, state: str) -> bool:
        return state == "RUNNING"  # COMPLETING: its ranks are ending already

    def check(self, job: JobConfig) -> None:
        sbatch_lines(job.cluster.sbatch)  # any sbatch option: known to sbatch, not one the toolkit sets, one printable value

    def refusal(self, job: JobConfig) -> str | None:
        cluster = job.cluster
        if job.dry_run or not cluster.container or cluster.container_runtime != "pyxis" or slurmctl.srun_has_option("--container-image") is not False:
            return None  # srun not here to ask: the submission will tell
        return (
            f"cluster.container={cluster.container}: this cluster's srun has no --container-image (the pyxis plugin is not installed); "
            "use cluster.container_runtime=apptainer where apptainer is, or run without cluster.container"
        )

    def dependency_state(self, job_id: str) -> str | None:
        return slurmctl.job_fields(job_id).get("JobState")  # slurmctld's own: a job only accounting knows cannot be waited on

    def signal_command(self, job_id: str, name: str) -> str:
        return f"scancel --signal={name} {job_id}"

    def cancel_hint(self, job_id: str) -> str:
        return f"scancel {job_id} cancels it"
