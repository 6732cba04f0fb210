"""The job's task as its config names it, built one way for the built-in loop (hpc.rank.main)
and for `python -m hpc.evaluate` (hpc.tools.evaluate)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc.config.schema import JobConfig
    from trainers.task import Task


def job_task(job: JobConfig) -> Task:
    """The job's task (built-in or the user's), on the input files launch.py pinned: one path,
    or the list of shards a glob matched."""
    from trainers.tasks import build_task

    path = job.data.path
    data_path = [Path(p) for p in path] if isinstance(path, list | tuple) else Path(path) if path else None
    return build_task(job.task, {"model": job.model, "data": job.data, "trainer": job.trainer, "data_path": data_path})
