"""From a validated job to running ranks: local mpirun, Slurm through submitit, job arrays,
frozen code, and the hand-typed sbatch path (prepare). Reaches the rank side only through its
entry point, hpc.rank.main. The Python API (`from hpc import submit`) is hpc.api."""
