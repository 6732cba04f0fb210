"""The one builder of an mpirun command line on this machine (local runs, the allreduce
benchmark's --np, the tests' workers). Standard library only: login-node code imports it."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path


def find_mpirun() -> str | None:
    """The mpirun next to this python first (a pip-installed Open MPI, which the mpi4py wheel
    then loads too: mixing it with the system's mpirun breaks PMIx), else the one on PATH."""
    for path in (str(Path(sys.executable).parent), None):
        for name in ("mpirun", "mpiexec"):
            found = shutil.which(name, path=path)
            if found:
                return found
    return None


def mpirun_command(ranks: int, program: Sequence[str], extra_args: Sequence[str] = (), mpirun: str | None = None) -> list[str]:
    """`mpirun -n RANKS ... PROGRAM` on this one machine: more ranks than cores is fine (a laptop
    run oversubscribes), and no binding, which is the rank's own job (hpc.rank.binding)."""
    return [mpirun or find_mpirun() or "mpirun", "-n", str(ranks), "--map-by", ":OVERSUBSCRIBE", "--bind-to", "none", *extra_args, *program]


def root_environment() -> dict[str, str]:
    """Open MPI refuses to run as root without both of these."""
    return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
