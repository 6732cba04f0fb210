#!/usr/bin/env bash
# The version ranges in pyproject.toml, at both ends: for Hydra, omegaconf and submitit, one
# virtualenv with the oldest versions the ranges allow and one with the newest, each running the
# login path's unit tests and one local job. Everything else (torch, mpi4py, pytest ...) is the
# active Python's pinned set (constraints.txt), seen through --system-site-packages.
#
#   scripts/test-ranges.sh            both ends (scripts/test.sh runs this first: a few minutes)
#   scripts/test-ranges.sh oldest     one end
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if (($#)); then ends=("$@"); else ends=(oldest newest); fi

# The login path: composition, flags, sweeps and searches, sbatch text through submitit, the step supervisor.
tests=(tests/unit/test_cli.py tests/unit/test_launch_path.py tests/unit/test_overrides.py
    tests/unit/test_sbatch.py tests/unit/test_sbatch_golden.py tests/unit/test_search.py tests/unit/test_sweep.py
    tests/unit/test_supervise.py tests/unit/test_prepare.py)

# "oldest": name==lower bound of each range; "newest": the ranges themselves, upgraded.
requirements() {
    "$python" - "$1" <<'PY'
import re, sys, tomllib
wanted = ("hydra-core", "omegaconf", "submitit")
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for dep in deps:
    name = re.split(r"[<>=!~ ]", dep, maxsplit=1)[0]
    if name in wanted:
        low = re.search(r">=\s*([\w.]+)", dep)
        if not low:
            sys.exit(f"test-ranges: {dep} has no lower bound")
        print(f"{name}=={low.group(1)}" if sys.argv[1] == "oldest" else dep)
PY
}

for end in "${ends[@]}"; do
    case "$end" in oldest | newest) ;; *) echo "usage: $0 [oldest|newest]" >&2; exit 2 ;; esac
    venv=$(mktemp -d "${TMPDIR:-/tmp}/hpc-ranges-$end.XXXXXX")
    trap 'rm -rf "$venv"' EXIT
    "$python" -m venv --system-site-packages "$venv"
    mapfile -t reqs < <(requirements "$end")
    upgrade=(); [[ $end == newest ]] && upgrade=(--upgrade)
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${upgrade[@]}" "${reqs[@]}"
    versions_of='import importlib.metadata as m; print(", ".join(f"{n} {m.version(n)}" for n in ("hydra-core", "omegaconf", "submitit")))'
    versions=$("$venv/bin/python" -c "$versions_of")
    echo "test-ranges: $end: $versions"
    if [[ $versions == "$("$python" -c "$versions_of")" ]]; then  # the whole suite runs on exactly these
        echo "test-ranges: $end: the active Python's own versions, which the test suite itself runs on"
        rm -rf "$venv"
        trap - EXIT
        continue
    fi
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 "${tests[@]}"
    job=$(mktemp -d "${TMPDIR:-/tmp}/hpc-ranges-job.XXXXXX")
    (cd "$job" && "$venv/bin/python" "$OLDPWD/launch.py" trainer.epochs=1 >launch.log 2>&1) || {
        tail -20 "$job/launch.log" >&2
        echo "test-ranges: $end: the local job failed ($versions)" >&2
        exit 1
    }
    grep -q "epoch 1/1" "$job/launch.log" || { echo "test-ranges: $end: the local job trained no epoch" >&2; exit 1; }
    echo "test-ranges: $end: login-path tests and a local job pass ($versions)"
    rm -rf "$venv" "$job"
    trap - EXIT
done
