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
exec python3 -m pytest -q -ra --durations=15 "$@"
