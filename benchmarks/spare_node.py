#!/usr/bin/env python
"""A lost node with one spare node against the requeue path, and a rank's crash, same job, on the
simulated Slurm.

    python benchmarks/spare_node.py [--rounds N (2)] [--paths spare,requeue,crash] [--hidden 1024]

Each trial submits a 2-node x 2-rank job, waits for step 8 and a committed checkpoint, and
SIGKILLs everything on a node of the step that is not the batch host (scripts/slurm-sim.sh
kill-node), as when a node loses power, or (crash) rank 1's process alone:
- spare:   `resources.spare_nodes=1`. The step supervisor (hpc.slurm.supervise) leaves the node
           out and starts the ranks on the spare, inside the allocation.
- requeue: no spare. The EXIT trap requeues the job. Slurm then holds it back (BeginTime, about
           2 minutes), and the benchmark skips that hold by starting it at once
           (`scontrol update starttime=now`). The hold is not in the figure, and queue waits are
           zero here (an idle cluster); both add to every requeue on a real one.
- crash:   rank 1 SIGKILLed (its node lives): the supervisor starts the ranks again in the
           allocation on the same nodes.
- hang:    rank 1 SIGSTOPped (alive, its connections open, silent): seen only by its heartbeat's
           silence (hpc.slurm.supervise.HEARTBEAT_SILENT_S), then the same restart.
- spare-store, crash-store: the same with `checkpoint.in_memory=false`: the restart reads the
           checkpoint from the store, not the nodes' memory (trainers.checkpoint.memory).
- spare-gloo, crash-gloo, hang-gloo: the same over DDP on Gloo (`comm=gloo`), where the ranks of
           the live nodes keep their processes (hpc.rank.parking: an in-process restart); `-fork`:
           with `cluster.in_process_restart=false`, every rank a new fork of its node's warm
           process, as on the engine.
The model is an MLP of two hidden layers of --hidden units (1024: a 12 MiB checkpoint with Adam's
state; 4096: 170 MiB).
Printed per trial: seconds from the kill to the first resumed step (rank 0's timeline: the first
step of the first start launched after the kill), the steps redone (trained before the kill,
trained again after it), and the interruption's total as rank 0 logged it (from the failure as
detected, not from the kill); at the end a table of each path's phases (detection, drain,
relaunch, start-up, checkpoint load, first step), median and range over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.simcluster import SIM, newest_committed_step, nodes_settled, parse_job_id, poll, restarts, start_job_now  # noqa: E402
from hpc.interruptions import TIMELINE  # noqa: E402
from hpc.rundir import RunDir, read_jsonl  # noqa: E402
from hpc.slurm.slurmctl import job_fields, job_state  # noqa: E402
from trainers.watchdog import heartbeat_file  # noqa: E402

PATHS = ("spare", "requeue", "crash", "spare-store", "crash-store", "hang", "spare-gloo", "spare-gloo-fork", "crash-gloo", "crash-gloo-fork", "hang-gloo")
JOB = (
    "cluster=simulated",
    "resources.nodes=2",
    "resources.tasks_per_node=2",
    "trainer.epochs=3",
    "checkpoint.every_steps=4",
    "checkpoint.every_minutes=null",
)


def step_rows(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "steps.jsonl")


def resumed_start(run_dir: Path, killed_at: float) -> dict | None:
    """Rank 0's timeline event for the first start launched after the kill (hpc.rank.timeline)."""
    return next((e for e in read_jsonl(run_dir / TIMELINE) if e.get("event") == "start" and float(e["launched"]) > killed_at), None)


def step_nodes(run_dir: Path) -> set[str]:
    """The nodes the ranks run on, from each rank log's first line."""
    hosts = set()
    for log in (run_dir / "logs").glob("rank-*.log"):
        first = next((line for line in log.read_text().splitlines() if " local_rank " in line), "")
        if " on " in first:
            hosts.add(first.split(" on ")[1].split()[0])
    return hosts


def trial(work: Path, path: str, hidden: int) -> dict:
    """One trial of `path`: spare (a node lost, a spare node allocated), requeue (a node lost, no
    spare) or crash (one rank SIGKILLed, its node alive: a restart in the allocation); `-store`:
    the checkpoint not kept in the nodes' memory."""
    kind, *modifiers = path.split("-")
    overrides = [
        *JOB,
        f"model.hidden_sizes=[{hidden},{hidden}]",
        *(["resources.spare_nodes=1"] if kind == "spare" else []),
        *(["checkpoint.in_memory=false"] if "store" in modifiers else []),
        *(["comm=gloo"] if "gloo" in modifiers else []),
        *(["cluster.in_process_restart=false"] if "fork" in modifiers else []),
        f"run_root={work / 'runs'}",
    ]
    submitted = subprocess.run([sys.executable, str(ROOT / "launch.py"), *overrides], cwd=work, capture_output=True, text=True, timeout=300)
    if submitted.returncode != 0:
        raise RuntimeError(submitted.stderr[-500:])
    job_id = parse_job_id(submitted.stdout)
    poll(lambda: bool(list(work.glob("runs/*/*/steps.jsonl"))), "the first step", 180)
    (run_dir,) = [path.parent for path in work.glob("runs/*/*/steps.jsonl")]
    poll(lambda: len(step_rows(run_dir)) >= 8 and newest_committed_step(run_dir) >= 4, "step 8 and a checkpoint", 180)
    lost = sorted(step_nodes(run_dir) - {job_fields(job_id)["BatchHost"]})[0]
    killed_at = time.time()
    if kind in ("crash", "hang"):
        os.kill(int(json.loads(heartbeat_file(RunDir(run_dir).heartbeats, 1).read_text())["pid"]), signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
    else:
        subprocess.run([SIM, "kill-node", lost], check=True, capture_output=True)
    before = max(row["step"] for row in step_rows(run_dir) if row["time"] <= killed_at)
    try:
        if kind == "requeue":
            poll(lambda: restarts(job_id) >= 1, "the requeue", 300)
            poll(lambda: job_state(job_id) == "PENDING", "the job to pend")
            poll(lambda: nodes_settled(except_nodes=[lost]), "the other nodes to settle", 300)
            start_job_now(job_id)
        poll(lambda: resumed_start(run_dir, killed_at) is not None, "the first resumed step", 400)
    finally:
        if kind not in ("crash", "hang"):
            subprocess.run([SIM, "revive-node", lost], check=True, capture_output=True)
    resumed = resumed_start(run_dir, killed_at)
    assert resumed is not None
    poll(lambda: job_state(job_id) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), "the job to end", 400)
    result = json.loads((run_dir / "result.json").read_text())
    to_first_step = float(resumed["first_step"]) - killed_at
    return {
        "path": path,
        "to_first_step_s": to_first_step,
        "phases": phases(resumed.get("cost", {}), to_first_step),
        "redone_steps": before - result["resumed_from"],
        "logged_cost": resumed.get("cost", {}).get("total_s"),
        "requeues": restarts(job_id),
        "in_process": sum("an in-process restart" in log.read_text() for log in (run_dir / "logs").glob("rank-*.log")),
        "completed": result["status"] == "completed",
    }


# The interruption's phases, in order: its detection (the kill -> the toolkit knowing: the step
# supervisor's failure record), then rank 0's logged cost (hpc.interruptions.Cost).
PHASES = (
    ("detection", None),
    ("drain", "to_exit_s"),
    ("relaunch", "relaunch_s"),
    ("start-up", "start_up_s"),
    ("load", "load_s"),
    ("first step", "first_step_s"),
)


def phases(cost: dict, to_first_step_s: float) -> dict[str, float | None]:
    """Seconds in each phase of one interruption; detection is what the logged total (from the
    failure as detected) leaves of the kill -> first resumed step."""
    found: dict[str, float | None] = {name: cost.get(key) for name, key in PHASES if key is not None}
    total = cost.get("total_s")
    found["detection"] = to_first_step_s - total if isinstance(total, int | float) else None
    return {name: found[name] for name, _ in PHASES}


def phase_table(rows: list[dict]) -> list[str]:
    """Per path, each phase's median and range over the trials, as a Markdown table."""
    lines = ["| path | trials | " + " | ".join(name for name, _ in PHASES) + " | kill -> first resumed step |", "|---|---:|" + "---:|" * (len(PHASES) + 1)]
    for path in PATHS:
        mine = [row for row in rows if row["path"] == path]
        if not mine:
            continue
        cells = []
        for name, _ in PHASES:
            values = [row["phases"][name] for row in mine if row["phases"].get(name) is not None]
            cells.append(spread(values))
        lines.append(f"| {path} | {len(mine)} | " + " | ".join(cells) + f" | {spread([row['to_first_step_s'] for row in mine])} |")
    return lines


def spread(values: list[float]) -> str:
    """`median (min-max)` in seconds; `-` for none."""
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", "--rounds", type=int, default=2, help="rounds: a trial of each path per round, interleaved (default 2)")
    parser.add_argument("--paths", default=",".join(PATHS[:3]), help=f"which of {','.join(PATHS)} to time, in each round (default: {','.join(PATHS[:3])})")
    parser.add_argument("--hidden", type=int, default=1024, help="units of the MLP's two hidden layers (default 1024)")
    args = parser.parse_args()
    paths = [path.strip() for path in args.paths.split(",")]
    if not set(paths) <= set(PATHS):
        parser.error(f"--paths: {args.paths}: each one of {', '.join(PATHS)}")
    rows = []
    for _ in range(args.trials):
        for path in paths:
            poll(nodes_settled, "an idle cluster", 300)
            work = tempfile.mkdtemp(prefix=f"spare-node-{path}-")
            try:
                row = trial(Path(work), path, args.hidden)
            except Exception:
                print(f"{path}: failed; its run dir is kept under {work}", file=sys.stderr, flush=True)
                raise
            shutil.rmtree(work, ignore_errors=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for path in paths:
        mine = [row for row in rows if row["path"] == path]
        print(
            f"{path}: kill -> first resumed step median {statistics.median(r['to_first_step_s'] for r in mine):.1f} s, "
            f"steps redone {[r['redone_steps'] for r in mine]}, requeues {[r['requeues'] for r in mine]}, "
            f"ranks restarted in their process {[r['in_process'] for r in mine]}, "
            f"completed {sum(r['completed'] for r in mine)}/{len(mine)}"
        )
    print("\n".join(phase_table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
