#!/usr/bin/env python
"""`python launch.py ...` in a checkout: the `hpc-launch` command (hpc/app.py) of an installed toolkit.

python launch.py                                   # embedded default: 2 local MPI ranks
python launch.py cluster=simulated resources.nodes=2 resources.tasks_per_node=2
python launch.py dry_run=true cluster=simulated    # print config + sbatch, submit nothing
python launch.py -m optim.lr=0.1,0.2 cluster=simulated sweep.max_parallel=1   # one job array
"""

from hpc.app import cli

if __name__ == "__main__":
    cli()
