#!/usr/bin/env bash
# A real S3-compatible server on this machine for the tests of checkpoints in object storage:
# moto's standalone server (moto[server], from the package registry, installed with the test
# extra). Chosen over Ceph's radosgw (Debian): one Python process that starts in about a second
# with no cluster (monitors, OSDs) behind it, speaking the S3 REST API that boto3/s3fs speak to
# AWS; it keeps objects in memory, so its speed is not a real S3's (docs/benchmarks.md says so).
#
#   scripts/s3-sim.sh start | stop | status | env
#
# `env` prints the standard variables a client needs (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...);
# the bucket hpctk-tests exists once `start` returns.
set -euo pipefail

command=${1:-start}
state_dir=${HPCTK_S3_STATE:-/var/tmp/hpctk-s3}
port=${HPCTK_S3_PORT:-9077}
bucket=hpctk-tests
endpoint="http://127.0.0.1:$port"
python=${PYTHON:-python3}

die() { echo "s3-sim: $*" >&2; exit 1; }

variables() {
    echo "AWS_ENDPOINT_URL=$endpoint"
    echo "AWS_ACCESS_KEY_ID=hpctk-test"
    echo "AWS_SECRET_ACCESS_KEY=hpctk-test-secret"
    echo "AWS_DEFAULT_REGION=us-east-1"
}

answering() {  # the server lists buckets
    "$python" - "$endpoint" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/", timeout=2).read()
PY
}

running() { [[ -f $state_dir/pid ]] && kill -0 "$(cat "$state_dir/pid")" 2>/dev/null; }

case "$command" in
start)
    mkdir -p "$state_dir"
    if ! running; then
        command -v moto_server >/dev/null || die "moto_server not found: pip install 'moto[server]' (scripts/install.sh installs it)"
        setsid moto_server -H 127.0.0.1 -p "$port" >"$state_dir/server.log" 2>&1 </dev/null &
        echo $! >"$state_dir/pid"
    fi
    deadline=$((SECONDS + 30))
    until answering; do
        running || die "moto_server exited: $(tail -3 "$state_dir/server.log")"
        ((SECONDS < deadline)) || die "moto_server did not answer on $endpoint within 30 s"
        sleep 0.2
    done
    env $(variables) "$python" -c "import boto3; boto3.client('s3').create_bucket(Bucket='$bucket')" >/dev/null
    variables >"$state_dir/env"
    echo "s3-sim: S3-compatible server (moto) on $endpoint, bucket $bucket"
    ;;
stop)
    if running; then kill "$(cat "$state_dir/pid")"; fi
    rm -f "$state_dir/pid" "$state_dir/env"
    ;;
status)
    running && answering && echo "s3-sim: up on $endpoint" || { echo "s3-sim: down"; exit 1; }
    ;;
env)
    variables
    ;;
*)
    die "usage: $0 start | stop | status | env"
    ;;
esac
