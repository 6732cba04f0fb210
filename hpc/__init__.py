"""Everything between `python launch.py` and a training rank, by where it runs.

    config/   login node: schemas, Hydra composition (sweep expansion too), one validate()
    launching/ login node: the launcher seam, local mpirun runs, job arrays, studies, frozen code
    slurm/    the Slurm plugin (schedulers.py finds it; any other scheduler is a package's entry
              point): its launcher (submitit), the sbatch text, the step supervisor the batch
              script runs srun under, the hand-typed sbatch path (prepare), SLURM_*, requeue
    rank/     every rank: stop signals from the first instruction, the entry point, binding,
              stop and requeue, the watchdog hookup, rank 0's timeline of starts and stops
    fabric/   pure library: node topology, rail-aware mapping, switch trees, the cost model
    tools/    what users run beside their jobs: status, report, topology; nothing imports them

Leaves imported by all of these and importing none of them: errors, rundir (the run-dir
layout), interruptions (what an interruption cost, from the timeline), env (the one reader of
OMPI_*/PMIX_*/torchrun variables; a scheduler's own through its plugin), schedulers (the
plugins' registry), cli (the argument parser of our commands). status, report,
topology and costmodel here are the public command names (`python -m hpc.status`).
`from hpc import submit` (hpc.api): launch.py's work from Python, in the calling process; what
it returns and raises: `from hpc import Job, SubmitError`.

Imports run one way: config -> launching -> (sbatch/srun/mpirun) -> rank -> trainers ->
collectives (an arrow: "imports"); tests/unit/test_import_rules.py checks it. The launching path never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpc.api import Job, SubmitError

__all__ = ["Job", "SubmitError", "submit"]


def submit(*overrides: str, **options: Any) -> Job | list[Job]:
    """hpc.api.submit: compose, check and submit a job (local ranks: started in the background);
    the job, or a grid sweep's jobs. Loaded when called: every rank imports `hpc`."""
    from hpc.api import submit as submit_job

    return submit_job(*overrides, **options)


def __getattr__(name: str) -> Any:
    """Job and SubmitError (hpc.api), loaded only when asked for."""
    if name in ("Job", "SubmitError"):
        from hpc import api

        return getattr(api, name)
    raise AttributeError(f"module 'hpc' has no attribute {name!r}")
