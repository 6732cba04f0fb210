#!/usr/bin/env bash
# Install everything (Python packages, Open MPI, Slurm + munge), start the simulated
# multi-node Slurm cluster, and run the whole test suite. `.ci/run` calls exactly this.
#
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --cluster
scripts/slurm-sim.sh start
# Lint, format and types first: seconds, and a failure here names the line.
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
# Under CI=true, tests that need Slurm or MPI fail instead of skipping (tests/conftest.py).
# --durations: the slowest tests end the log, to keep the suite well inside CI's limit.
if (($#)); then  # the tests asked for, as asked
    exec python3 -m pytest -q -ra --durations=15 "$@"
fi
# The unit tier needs neither Slurm nor MPI and runs its tests two at a time (pytest-xdist); the
# tiers with ranks and jobs run one test at a time, as their timing needs. The time by tier
# that ends the log adds up both runs.
HPCTK_TIER_TIMES=$(mktemp)
export HPCTK_TIER_TIMES
trap 'rm -f "$HPCTK_TIER_TIMES"' EXIT
unit=0
python3 -m pytest -q -ra -n 2 tests/unit || unit=$?
python3 -m pytest -q -ra --durations=15 tests/mpi tests/net tests/e2e
exit "$unit"
