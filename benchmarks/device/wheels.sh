#!/usr/bin/env bash
# The pure-Python wheels the lent GPU machine lacks (it reaches no package registry), built here
# into .device/wheels (git-ignored), which the device call carries: run(carry=[".device"]).
# There, `python3 -m benchmarks.device` installs them offline before its checks.
#
#   benchmarks/device/wheels.sh            (versions: the ones installed here, else the pins below)
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
out=.device/wheels
rm -rf "$out" && mkdir -p "$out"
installed() { "$python" -c "from importlib.metadata import version; print(version('$1'))" 2>/dev/null || echo "$2"; }
specs=(
    "hydra-core==$(installed hydra-core 1.3.8)"
    "omegaconf==$(installed omegaconf 2.3.0)"
    "antlr4-python3-runtime==$(installed antlr4-python3-runtime 4.9.3)"
    "submitit==$(installed submitit 1.5.4)"
    "python-hostlist==$(installed python-hostlist 2.3.0)"
)
# --no-deps: the GPU machine has PyYAML, cloudpickle and typing-extensions; sdists (antlr4,
# python-hostlist) are built into wheels here, since there is no build backend to fetch there.
"$python" -m pip wheel -q --no-deps -w "$out" "${specs[@]}"
ls "$out"
