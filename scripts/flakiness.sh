#!/usr/bin/env bash
# The slow tiers (mpi, net, e2e) several times in a row on this machine, as scripts/test.sh runs
# them (three workers, the Slurm tests in one group, CI=true: nothing skips). A test that fails in
# any round is flaky or broken: it blocks a landing (issue 46). Each round's summary line and the
# failures are printed at the end; the exit status is non-zero if any round failed.
#
#   scripts/flakiness.sh [ROUNDS]        (default 3; about 25 minutes a round on 2 cores)
#
# Expects what scripts/test.sh installs and starts (Open MPI, the simulated Slurm cluster).
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "error: ROUNDS must be a whole number >= 1, not '$rounds'" >&2; exit 2; }
logs=$(mktemp -d "${TMPDIR:-/tmp}/flakiness.XXXXXX")
failed=0
for ((round = 1; round <= rounds; round++)); do
    log="${logs}/round-${round}.log"
    started=$SECONDS
    CI=true python3 -m pytest -q -ra -n 3 --dist loadgroup -p no:cacheprovider tests/mpi tests/net tests/e2e >"$log" 2>&1
    status=$?
    echo "round ${round}/${rounds}: exit ${status} in $(((SECONDS - started) / 60)) min: $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" | tail -1)"
    if ((status != 0)); then
        failed=$((failed + 1))
        grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
    fi
done
echo "${failed} of ${rounds} rounds failed; logs in ${logs}"
((failed == 0))
