#!/usr/bin/env bash
# Install everything (Python packages, Open MPI, Slurm + munge), start the simulated
# multi-node Slurm cluster, and run the whole test suite. `.ci/run` calls exactly this.
#
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test --cluster
# Side by side, each into its own log, shown as it ends: the simulated cluster and an
# S3-compatible server (moto, for the object-store checkpoint tests) start, which mostly waits on
# daemons; lint, format and types (a failure names the line); and pyproject.toml's version ranges
# at both ends (Hydra, omegaconf, submitit: the login path's tests and one local job, a
# virtualenv each). One after another they left a core idle for about a minute.
setup_logs=$(mktemp -d "${TMPDIR:-/tmp}/hpc-setup.XXXXXX")
names=() pids=()
begin() {  # begin NAME COMMAND...
    names+=("$1"); "${@:2}" >"$setup_logs/$1.log" 2>&1 & pids+=($!)
}
begin cluster scripts/slurm-sim.sh start
begin s3 scripts/s3-sim.sh start
begin lint bash -c 'python3 -m ruff check . && python3 -m ruff format --check . && python3 -m mypy'
if ((!$#)); then begin ranges scripts/test-ranges.sh; fi
failed=()
for i in "${!names[@]}"; do
    status=ok; wait "${pids[$i]}" || { status=FAILED; failed+=("${names[$i]}"); }
    echo "=== setup: ${names[$i]} ($status)"; cat "$setup_logs/${names[$i]}.log"
done
rm -rf "$setup_logs"
if ((${#failed[@]})); then echo "test.sh: set-up failed: ${failed[*]}" >&2; exit 1; fi
# Under CI=true, tests that need Slurm or MPI fail instead of skipping (tests/conftest.py).
# --durations: the slowest tests end the log, to keep the suite well inside CI's limit.
if (($#)); then  # the tests asked for, as asked
    exec python3 -m pytest -q -ra --durations=15 "$@"
fi
# Three workers (pytest-xdist) on the two cores: the Slurm tests run one after another on one of
# them (one group, tests/conftest.py), everything else on the other two, then on all three once
# the Slurm tests are done. A Slurm test mostly waits for Slurm (its ranks are slurmd's, a few
# CPU-seconds a job), while rank starts and launchers each keep a core busy: with two workers a
# fifth of the cores stayed idle (24.6 min, 2026-12-03), with three 3 % (22.4 min). The time by
# tier that ends the log adds up the tests of each tier (more than the wall time, which pytest
# prints). The unit tier comes last: its many short tests fill the end, after the long ones.
exec python3 -m pytest -q -ra -n 3 --dist loadgroup --durations=15 tests/mpi tests/net tests/e2e tests/unit
