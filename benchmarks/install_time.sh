#!/usr/bin/env bash
# The README's first command's install, timed in fresh virtualenvs: scripts/install.sh (the
# toolkit and every optional part it runs) against scripts/install.sh --test (the test tools
# too), alternated, ROUNDS rounds (default 2). Prints one line per install; no tests, no Slurm.
#
#   benchmarks/install_time.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-2}" in
-h | --help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
*[!0-9]* | "") echo "usage: $0 [ROUNDS]" >&2; exit 2 ;;
esac
rounds=${1:-2}
work=$(mktemp -d "${TMPDIR:-/tmp}/hpc-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
for ((round = 1; round <= rounds; round++)); do
    order=("" --test)
    ((round % 2)) || order=(--test "")
    for flag in "${order[@]}"; do
        venv="$work/venv-$round${flag:+-test}"
        python3 -m venv "$venv"
        start=$(date +%s.%N)
        PYTHON="$venv/bin/python" scripts/install.sh $flag >"$venv.log" 2>&1 || { cat "$venv.log" >&2; exit 1; }
        end=$(date +%s.%N)
        echo "round $round: scripts/install.sh ${flag:-(no flag)}: $(echo "$end - $start" | bc) s, $(du -sm "$venv" | cut -f1) MiB"
        rm -rf "$venv"
    done
done
