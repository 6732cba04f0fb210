"""Everything between `python launch.py` and a training rank, by where it runs.

    config/   login node: schemas, Hydra composition (sweep expansion too), one validate()
    submit/   login node and the batch script's host: local mpirun runs, Slurm through
              submitit, job arrays, frozen code, the hand-typed sbatch path (prepare), and the
              step supervisor the batch script runs srun under (restarts inside the allocation)
    rank/     every rank: stop signals from the first instruction, the entry point, binding,
              stop and requeue, the watchdog hookup, rank 0's timeline of starts and stops
    fabric/   pure library: node topology, rail-aware mapping, switch trees, the cost model
    tools/    what users run beside their jobs: status, report, topology; nothing imports them

Leaves imported by all of these and importing none of them: errors, rundir (the run-dir
layout), interruptions (what an interruption cost, from the timeline), env (the one reader of SLURM_*/OMPI_*/PMIX_*/torchrun variables), slurmctl (every
scontrol/squeue/sacct call), cli (the argument parser of our commands). status, report,
topology and costmodel here are the public command names (`python -m hpc.status`).
`from hpc import submit`: launch.py from Python (hpc.submit.api; its Job and SubmitError are
`from hpc.submit import Job, SubmitError`).

Imports run one way: config -> submit -> (sbatch/srun/mpirun) -> rank -> trainers ->
collectives (an arrow: "imports"); tests/unit/test_import_rules.py checks it. The submit path never imports torch.
"""

__all__ = ["submit"]  # the hpc.submit package, callable (its __init__): loaded only when asked for, every rank imports hpc
