#!/usr/bin/env bash
# A stop and requeue of the same 2-node x 2-rank job on the simulated Slurm, warm ranks on and off
# (cluster.warm_ranks), interleaved: the cost of the interruption beyond Slurm's requeue hold and
# queue wait, as rank 0 logged it (hpc.interruptions), and its phases. The job's start is its batch
# script's first line (Slurm's StartTime has whole seconds, and its launch of the script is Slurm's);
# the figure from StartTime is printed beside it.
#
#   benchmarks/warm_requeue.sh [ROUNDS (3)]
#
# The stop is `python -m hpc.stop RUN_DIR` (scancel --signal=USR1, as a preemption's signal) after
# step 8; the requeued job is started at once once its nodes are clean (Slurm's hold skipped).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-3}

one() {  # one WARM: a job, its stop, its requeue; prints a line of seconds
    local warm=$1 work run_dir job
    work=$(mktemp -d "${TMPDIR:-/tmp}/warm-requeue.XXXXXX")
    (cd "$work" && python3 "$root/launch.py" cluster=simulated resources.nodes=2 resources.tasks_per_node=2 "model.hidden_sizes=[1024,1024]" \
        trainer.epochs=6 checkpoint.every_steps=5 checkpoint.every_minutes=null "cluster.warm_ranks=$warm" "run_root=$work/runs" >/dev/null)
    run_dir=$(ls -d "$work"/runs/*/*/)
    until [[ -f $run_dir/steps.jsonl ]] && (($(wc -l <"$run_dir/steps.jsonl") >= 8)); do sleep 0.3; done
    job=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['job_id'])" "$run_dir/job.json")
    python3 -m hpc.stop "$run_dir" >/dev/null
    (cd "$root" && python3 - "$job" "$run_dir" "$warm" <<'PY'
import json, sys
from benchmarks.simcluster import nodes_settled, poll, restarts, start_job_now
from hpc.slurm.slurmctl import job_state
job, run_dir, warm = sys.argv[1:]
poll(lambda: restarts(job) >= 1 and job_state(job) == "PENDING", "the requeue")
poll(nodes_settled, "the nodes to settle", 300)
start_job_now(job)
poll(lambda: job_state(job) in ("COMPLETED", "FAILED", "CANCELLED"), "the job to end", 300)
(start,) = [e for e in map(json.loads, open(f"{run_dir}/timeline.jsonl")) if "cost" in e]
cost = start["cost"]
beyond = cost["total_s"] - (cost.get("held_s") or 0) - (cost.get("queued_s") or 0)
# Slurm's StartTime (whole seconds) instead of the batch script's first line: Slurm's launch of it counted as ours
launch = start["job_started"] - start["slurm_started"] if start.get("slurm_started") else float("nan")
phases = " ".join(f"{k[:-2]} {v:.1f}" for k, v in cost.items() if isinstance(v, float))
print(f"warm_ranks={warm}: {beyond:.1f} s beyond the hold ({beyond + launch:.1f} from Slurm's StartTime) ({phases})", flush=True)
PY
    )
    rm -rf "$work"
}

scancel -u "$(id -un)" 2>/dev/null || true
for ((i = 0; i < rounds; i++)); do
    one true
    one false
done
