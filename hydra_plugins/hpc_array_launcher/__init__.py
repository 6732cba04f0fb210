"""Hydra launcher `hpc_array`: `launch.py -m` submits the whole sweep as Slurm job arrays
(hpc.submit.sweep) and returns at once, instead of one job per point and a wait for all of them."""
