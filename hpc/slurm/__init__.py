"""The Slurm plugin (hpc.schedulers): everything that knows Slurm, and nothing else does.

Login side: launcher (SlurmLauncher: submission through submitit, states, cancel, signals,
waits), batch (the sbatch script and its EXIT trap), prepare (a hand-typed sbatch script's run
dir). Batch side: supervise (the step supervisor: restarts and spares inside the allocation),
warmnodes (the warm processes per node). Rank side: environment (SLURM_* variables), job
(requeue, the batch script's markers). slurmctl runs Slurm's tools for all of them.
Imports nothing at package level: a rank importing hpc.slurm.job loads no login code.
"""
