"""FakeQ: a scheduler that exists only in the tests, as a plugin a package would ship
(hpc.schedulers): found through its entry point (`register` writes the package's metadata),
never named by the toolkit. Its login side records what it is given; its ranks read FAKEQ_*
variables; its requeue writes a line to the file FAKEQ_REQUEUES names."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from hpc.config.launchers import LauncherTraits
from hpc.env import PORT_BASE, PORT_SPAN, RankInfo
from hpc.errors import UserError
from hpc.launching.launchers import GONE, QueuedJob, QueuedLauncher
from hpc.rank.lifecycle import EXIT_RESUMABLE
from hpc.rank.scheduler import NoScheduler, StopPlan
from hpc.schedulers import SchedulerPlugin

FAKE = LauncherTraits("fakeq", "FakeQ", True, False, True, "true", "no fakeq", job_id_form=r"q\d+(\.\d+)?", job_id_examples=("q1", "q2", "q1.0"))
PLUGIN = SchedulerPlugin(
    "fakeq",
    traits="tests.plugins.fakeq:FAKE",
    launcher="tests.plugins.fakeq:FakeQueue",
    environment="tests.plugins.fakeq:ENVIRONMENT",
    job="tests.plugins.fakeq:FakeQJob",
)
CLASH = replace(PLUGIN, name="slurm")  # a plugin that would take a built-in scheduler's name


def register(folder: Path) -> Path:
    """Make `folder` an installed package that declares PLUGIN (put it on sys.path or PYTHONPATH)."""
    meta = folder / "fakeq_plugin-1.0.dist-info"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeq-plugin\nVersion: 1.0\n")
    (meta / "entry_points.txt").write_text("[hpc.schedulers]\nfakeq = tests.plugins.fakeq:PLUGIN\n")
    return folder


class FakeQueue(QueuedLauncher):
    traits = FAKE
    terminal_states = frozenset({"DONE", "BROKEN"})
    waiting_states = frozenset({"QUEUED"})
    running_states = frozenset({"GOING"})
    succeeded_states = frozenset({"DONE"})

    def __init__(self) -> None:
        self.arrays: list[tuple[dict[str, Any], list[str], int | None]] = []
        self.states: dict[str, str] = {}
        self.submitted: Path | None = None

    def check(self, job):
        if job.cluster.sbatch:  # its settings are its own: Slurm's options mean nothing to it
            raise UserError(f"cluster.sbatch: FakeQ takes no sbatch options ({', '.join(sorted(job.cluster.sbatch))})")

    def dry_run(self, job, env, run_dir):
        return "# fakeq script"

    def submit(self, job, env, run_dir, code):
        self.submitted = run_dir.path
        return self.submit_array(self.array_parameters(job, env, code), [run_dir], code, None)[1][0]

    def array_parameters(self, job, env, code):
        return {"nodes": job.resources.nodes, "after": []}

    def max_array_size(self):
        return 2

    def after_any(self, params, job_id):
        return {**params, "after": [*params["after"], job_id]}

    def submit_array(self, params, run_dirs, folder, max_parallel):
        array = f"q{len(self.arrays)}"
        self.arrays.append((params, [run_dir.path.name for run_dir in run_dirs], max_parallel))
        return array, [f"{array}.{i}" for i in range(len(run_dirs))], f"# fakeq array {array}"

    def render_array(self, params, folder, run_dirs, max_parallel):
        return f"# fakeq array of {len(run_dirs)}"

    def jobs(self, job_ids):
        return {job_id: QueuedJob(self.states.get(job_id, GONE)) for job_id in job_ids}

    def cancel(self, job_id):
        return None

    def signal(self, job_id, name):
        return None

    def wait(self, job_id, run_dir, emit=print, emit_err=print):
        return self.states.get(job_id, GONE)


class FakeQEnvironment:
    """FAKEQ_JOB (q<n>), FAKEQ_RANK, FAKEQ_SIZE, FAKEQ_NODES (comma-separated), FAKEQ_PER_NODE,
    FAKEQ_RESTARTS, FAKEQ_CPUS."""

    def job_id(self, env: Mapping[str, str]) -> str | None:
        return env.get("FAKEQ_JOB")

    def task(self, env: Mapping[str, str]) -> RankInfo | None:
        if "FAKEQ_RANK" not in env:
            return None
        rank, per_node = int(env["FAKEQ_RANK"]), int(env.get("FAKEQ_PER_NODE", "1"))
        hosts = self.hosts(env)
        return RankInfo(rank, rank % per_node, int(env["FAKEQ_SIZE"]), per_node, rank // per_node, len(hosts), hosts, "fakeq")

    def task_place(self, env: Mapping[str, str]) -> tuple[str, str] | None:
        return env.get("FAKEQ_RANK", "?"), self.hosts(env)[int(env.get("FAKEQ_RANK", "0")) // int(env.get("FAKEQ_PER_NODE", "1"))]

    def hosts(self, env: Mapping[str, str]) -> tuple[str, ...]:
        return tuple(env.get("FAKEQ_NODES", "localhost").split(","))

    def restart_count(self, env: Mapping[str, str]) -> int:
        return int(env.get("FAKEQ_RESTARTS", "0"))

    def cpus_per_task(self, env: Mapping[str, str]) -> int | None:
        return int(env["FAKEQ_CPUS"]) if "FAKEQ_CPUS" in env else None

    def rendezvous(self, env: Mapping[str, str]) -> tuple[str, int] | None:
        return self.hosts(env)[0], PORT_BASE + int(env["FAKEQ_JOB"].lstrip("q")) % PORT_SPAN


ENVIRONMENT = FakeQEnvironment()


class FakeQJob(NoScheduler):
    """The ranks' side: a stop requeues the job, by a line in FAKEQ_REQUEUES; no batch script
    to tell anything (NoScheduler's answers)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def job_id(self) -> str | None:
        return self.env.get("FAKEQ_JOB")

    def plan_after_stop(self, received_at: datetime, signal_seconds: int) -> StopPlan:
        if "FAKEQ_REQUEUES" not in self.env:
            return StopPlan(f"FakeQ cannot requeue job {self.job_id()}", None, EXIT_RESUMABLE)
        return StopPlan(f"FakeQ requeues job {self.job_id()}", self.job_id(), 0)

    def can_requeue(self) -> bool:
        return "FAKEQ_REQUEUES" in self.env

    def requeue(self, job_id: str) -> str | None:
        with open(self.env["FAKEQ_REQUEUES"], "a") as f:
            f.write(f"requeue {job_id}\n")
        return None

    def resume_command(self, run_dir: Path) -> str:
        return f"fakeq resubmit {shlex.quote(str(run_dir))}"
