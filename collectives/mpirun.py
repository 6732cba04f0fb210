"""The one builder of an mpirun command line on this machine (local runs, the allreduce
benchmark's --np, the tests' workers). Standard library only: login-node code imports it."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
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


HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def huge_pages_environment(current: Mapping[str, str]) -> dict[str, str]:
    """With it, torch's CPU allocator asks the kernel for transparent huge pages (madvise) for
    tensors of 2 MiB and more, where THP is `madvise` or `always`: fewer page faults and TLB
    misses. Allreduces of 16-64 MiB ran 15-25% faster on 2 ranks, and their spread between
    launches narrowed. torch reads the variable once, at its first allocation, so it must be in
    the rank's environment from the start. A value the user exported (0, say) is the one passed
    on: clusters whose sbatch defaults to --export=NONE would not carry it to the ranks."""
    return {HUGE_PAGES: current.get(HUGE_PAGES, "1")}


def local_ranks_environment(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of ranks that mpirun starts on this machine outside a job (the benchmarks,
    the tests): as a job's ranks run (huge pages, root allowed), one thread each, since they
    share the cores."""
    return {**base, **root_environment(), **one_machine_environment(base), **huge_pages_environment(base), "OMP_NUM_THREADS": "1"}


PMIX_SECURITY = "PMIX_MCA_psec"
YIELD_WHEN_IDLE = "OMPI_MCA_mpi_yield_when_idle"


def one_machine_environment(current: Mapping[str, str]) -> dict[str, str]:
    """For mpirun on this machine alone (never under srun, whose PMIx server decides).

    PMIx authenticates its clients through munge where that plugin is installed: with munge
    installed and its daemon stopped (a workstation, a login node), every mpirun waited 2.3 s for
    the socket before starting a rank. The ranks are this user's, on this machine: the native
    check (the socket's peer credentials) is the same guarantee.

    Ranks here share the cores with each other, their loader workers, the launcher and whatever
    else the machine runs, and Open MPI's blocking calls spin in its progress loop (a rank that
    imported torch first waits for its peers at full speed): they yield the core between polls.
    Open MPI does so by itself only where mpirun counts more ranks than cores. Measured: a 2-rank
    local job beside one CPU-bound process used 13.5 s of CPU instead of 15.5-18 s and ended
    2.5-4.5 s sooner; alone, the same. A value the user set is kept, for both."""
    return {PMIX_SECURITY: current.get(PMIX_SECURITY, "native"), YIELD_WHEN_IDLE: current.get(YIELD_WHEN_IDLE, "1")}
