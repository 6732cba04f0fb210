"""Inside an allocation that a user got with plain `sbatch`: compose, check, make the run dir.

    exports=$(python3 -m hpc.slurm.prepare [hydra overrides...]) || exit $?
    eval "$exports"        # HPCTK_RUN_DIR and the ranks' environment, shell-quoted
    srun --mpi=pmix python3 -m hpc.rank.main "$HPCTK_RUN_DIR"

The allocation Slurm granted is authoritative: resources.nodes and resources.tasks_per_node are
taken from it, and an override that contradicts it is refused. As with launch.py, the run dir
gets `run_access` (private by default: the umask exported to the ranks too), a job.json that
hpc.status reads, and the code frozen (at the job's first start) in <run dir>/code, which every
start runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from hpc.config.compose import compose_job
from hpc.config.schema import ACCESS_UMASKS, JobConfig, apply_run_access
from hpc.config.scripts import split_passthrough, with_script_args
from hpc.config.validate import validate_job
from hpc.env import RUN_DIR_VARIABLE, RankEnvError
from hpc.errors import UserError
from hpc.launching.launch import pin_inputs, rank_environment, resolved_yaml
from hpc.launching.snapshot import freeze_job_code
from hpc.rundir import RunDir, mark_run_dir
from hpc.slurm.batch import setup_lines
from hpc.slurm.environment import allocation_shape, slurm_job_id


def granted_shape(env: Mapping[str, str]) -> tuple[int, int]:
    """(nodes, tasks per node) Slurm granted this batch job; UserError outside an allocation."""
    try:
        shape = allocation_shape(env)
    except RankEnvError as err:
        raise UserError(str(err)) from None
    if shape is None:
        raise UserError("hpc.slurm.prepare runs inside an sbatch allocation (SLURM_JOB_NUM_NODES is not set)")
    return shape


def fit_to_allocation(job: JobConfig, nodes: int, tasks_per_node: int, overrides: list[str]) -> JobConfig:
    for key, granted in (("resources.nodes", nodes), ("resources.tasks_per_node", tasks_per_node)):
        asked = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
        if asked and asked[-1] != str(granted):
            raise UserError(f"{key}={asked[-1]} but sbatch granted {granted}; change the #SBATCH/--nodes/--ntasks-per-node flags instead")
    return replace(job, resources=replace(job.resources, nodes=nodes, tasks_per_node=tasks_per_node))


def job_run_dir(job: JobConfig, job_id: str) -> tuple[RunDir, bool]:
    """The run dir of this Slurm job: the same one after every requeue, so it resumes.
    Returns (run dir, whether it already existed)."""
    path = Path(job.run_root).resolve() / "jobs" / f"{job_id}_{job.name}"
    existed = (path / "config.yaml").is_file()
    mark_run_dir(path)
    return RunDir(path), existed


def prepare_exports(argv: list[str], env: Mapping[str, str]) -> str:
    """The shell lines that export the run dir and the ranks' environment; `argv`: Hydra
    overrides, then after `--` a script's own arguments (verbatim), as launch.py takes them."""
    overrides, script_args = split_passthrough(argv)
    nodes, tasks_per_node = granted_shape(env)
    job = fit_to_allocation(compose_job(overrides), nodes, tasks_per_node, overrides)
    job = with_script_args(job, script_args)
    job = pin_inputs(job, validate_job(job, in_allocation=True))
    job_id = slurm_job_id(env) or "nojob"
    apply_run_access(job.run_access)  # the run dir and all in it as a launcher's run: private by default
    run_dir, existed = job_run_dir(job, job_id)
    if not existed:  # after a requeue the first config stays: the checkpoints were made with it
        run_dir.config.write_text(resolved_yaml(job))
    # The code of the job's first start, frozen: a requeue next week runs it, not the checkout as
    # it then is. (sbatch keeps only the batch script: the code as it was at submission is gone
    # by the first start; launch.py freezes at submission.)
    code = run_dir.code if run_dir.code.is_dir() else freeze_job_code(run_dir.code, job)
    run_dir.write_json(run_dir.job, {"job_id": job_id, "launcher": "slurm", "started_by": "sbatch", "cluster": job.cluster.name, "run_dir": str(run_dir.path)})
    lines = setup_lines({**rank_environment(job), RUN_DIR_VARIABLE: str(run_dir.path)}, code)
    umask = ACCESS_UMASKS.get(job.run_access)
    return "\n".join([*lines, "export PYTHONSAFEPATH=1", *([f"umask {umask:04o}"] if umask is not None else [])])


def main(argv: list[str]) -> int:
    try:
        print(prepare_exports(argv, os.environ))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
