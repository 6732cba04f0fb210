#!/usr/bin/env bash
# Install everything (Python packages, Open MPI, Slurm + munge), start the simulated
# multi-node Slurm cluster, and run the whole test suite. `.ci/run` calls exactly this.
#
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --cluster
scripts/slurm-sim.sh start
scripts/s3-sim.sh start  # an S3-compatible server (moto) for the object-store checkpoint tests
# Lint, format and types first: seconds, and a failure here names the line.
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
# Under CI=true, tests that need Slurm or MPI fail instead of skipping (tests/conftest.py).
# pyproject.toml's version ranges at both ends (Hydra, omegaconf, submitit): the login path's
# tests and one local job, a virtualenv each (about 2 minutes).
if ((!$#)); then scripts/test-ranges.sh; fi
# --durations: the slowest tests end the log, to keep the suite well inside CI's limit.
if (($#)); then  # the tests asked for, as asked
    exec python3 -m pytest -q -ra --durations=15 "$@"
fi
# Two workers (pytest-xdist): the Slurm tests run one after another on one of them (one group,
# tests/conftest.py), everything else on the other, then on both once the Slurm tests are done.
# Rank starts and launchers each keep one core busy and Slurm tests mostly wait, so side by side
# they fill the two cores (one stream alone left a third of them idle). The time by tier that
# ends the log adds up the tests of each tier (more than the wall time, which pytest prints).
# The unit tier comes last: its many short tests fill the end, after the long ones have started.
exec python3 -m pytest -q -ra -n 2 --dist loadgroup --durations=15 tests/mpi tests/net tests/e2e tests/unit
