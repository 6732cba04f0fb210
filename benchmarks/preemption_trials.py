#!/usr/bin/env python
"""Real preemptions on the simulated Slurm, at random moments or on a fixed period: every run must
complete bit-identical to an uninterrupted one; the cost of each interruption and the goodput.

    python benchmarks/preemption_trials.py random [--preemptions 20] [--seeds 1 2 3] [--window 20]
    python benchmarks/preemption_trials.py every --period 60 300 [--epochs 300]

A preemption is a real one: a job in partition `high` asking for every node (exclusive) preempts
ours (PreemptMode=REQUEUE, preempt_send_user_signal: USR1 to every rank, GraceTime 20 s). The
ranks stop, save and the job requeues. The benchmark starts it again at once: Slurm's requeue hold
(BeginTime, about 2 minutes) and the queue wait are left out, and the goodput counts them apart.
- random: after every start of the job (its StartTime), a moment drawn uniformly from
  [0, --window) s, so start-up, checkpoint loading, saves, evaluation and training are all hit.
  Then --preemptions of them, for each seed (the seed draws the moments; the training is the same).
- every: a preemption --period seconds after every start of the job, one run per period.
Checked per run: completed; per-step losses and final weights equal to the uninterrupted run's
(run once first, same job, shared by every run); no interruption redid more than one checkpoint
interval. Reported: the
median of each stretch of rank 0's interruption costs (hpc.interruptions), and three goodputs:
- the steps' goodput: the time in steps that count (each step's last run) / the wall time from
  the first start to the end (what is left of Slurm's hold and queue wait, once the benchmark
  releases the job at once, included), the uninterrupted run's beside it;
- the same with Slurm's hold and queue wait taken out of the wall time (each interruption's
  `held_s` and `queued_s`);
- the job's goodput: the uninterrupted run's wall time / this run's, hold and queue wait taken
  out: the share of the time the interruptions leave to the job's own work (its steps,
  evaluations and saves, as the uninterrupted run does them). The issue's targets (0.85 at a
  preemption every 60 s, 0.97 every 300 s) are about what the interruptions cost: this one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.simcluster import nodes_settled, parse_job_id, poll, restarts, start_job_now  # noqa: E402
from hpc.interruptions import TIMELINE, costs  # noqa: E402
from hpc.rundir import read_jsonl  # noqa: E402
from hpc.slurm.slurmctl import TERMINAL_STATES, job_fields, job_state, submit_wrapped  # noqa: E402

EVERY_STEPS = 5
STRETCHES = ("to_stop_s", "to_commit_s", "to_exit_s", "relaunch_s", "held_s", "queued_s", "start_up_s", "load_s", "first_step_s", "total_s")


def job_overrides(epochs: int) -> list[str]:
    return [
        "cluster=simulated",
        "resources.nodes=2",
        "resources.tasks_per_node=2",
        "model.hidden_sizes=[512,512]",
        f"trainer.epochs={epochs}",
        f"checkpoint.every_steps={EVERY_STEPS}",
        "checkpoint.every_minutes=null",
    ]


def submit(work: Path, overrides: list[str]) -> tuple[str, Path]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *overrides, f"run_root={work / 'runs'}"], cwd=work, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-500:])
    job_id = parse_job_id(done.stdout)
    poll(lambda: bool(list(work.glob("runs/*/*/config.yaml"))), "the run dir")
    (config,) = work.glob("runs/*/*/config.yaml")
    return job_id, config.parent


def started_at(job_id: str) -> float:
    value = job_fields(job_id).get("StartTime", "")
    return datetime.fromisoformat(value).timestamp() if value[:1].isdigit() else time.time()


def preempt_and_restart(job_id: str) -> bool:
    """A real preemption; False when the job ended (completed) before it was preempted."""
    before = restarts(job_id)
    preemptor, error = submit_wrapped("true", "-p", "high", "-N", "4", "--exclusive", "-o", "/dev/null")
    if preemptor is None:
        raise RuntimeError(f"sbatch of the preemptor: {error}")
    poll(lambda: restarts(job_id) > before or job_state(job_id) in TERMINAL_STATES, "the preemption", 180)
    poll(lambda: job_state(preemptor) in TERMINAL_STATES, "the preemptor to run", 180)
    if restarts(job_id) <= before:
        return False
    poll(lambda: job_state(job_id) == "PENDING", "the job to pend")
    poll(nodes_settled, "the nodes to settle", 180)
    start_job_now(job_id)  # Slurm's requeue hold and the queue wait: left out, counted apart
    poll(lambda: job_state(job_id) != "PENDING", "the job to start", 180)
    return True


def wait_done(job_id: str, timeout_s: float = 3600) -> str:
    poll(lambda: job_state(job_id) in TERMINAL_STATES, f"job {job_id} to end", timeout_s)
    return job_state(job_id)


def losses(run_dir: Path) -> dict[int, float]:
    return {int(row["step"]): float(row["loss"]) for row in read_jsonl(run_dir / "steps.jsonl")}


def weights_digest(run_dir: Path) -> str:
    """sha256 of the newest checkpoint's model tensors (torch imported only here)."""
    import hashlib

    from trainers.checkpoint.layout import SHARED, committed_steps, step_dir_name
    from trainers.checkpoint.tensorfile import read_tensor_file

    newest = run_dir / "checkpoints" / step_dir_name(committed_steps(run_dir / "checkpoints")[-1])
    state = read_tensor_file(newest / SHARED)
    digest = hashlib.sha256()
    for name, tensor in sorted(state.get("state", state)["model"].items()):  # the registry's layout, or the loop's before it
        digest.update(name.encode() + tensor.numpy().tobytes())
    return digest.hexdigest()


def goodput(run_dir: Path, first_start: float, ended: float, waited_s: float) -> float:
    """Seconds in steps that count (each step's last run) over the wall time, waits excluded."""
    counted = {int(row["step"]): float(row["step_ms"]) / 1000 for row in read_jsonl(run_dir / "steps.jsonl")}
    return sum(counted.values()) / max(ended - first_start - waited_s, 1e-9)


def job_goodput(uninterrupted_s: float, wall_s: float, waited_s: float) -> float:
    """The uninterrupted run's wall time over this run's, Slurm's hold and queue wait taken out."""
    return uninterrupted_s / max(wall_s - waited_s, 1e-9)


def run_job(work: Path, overrides: list[str], next_delay: Callable[[int], float | None]) -> dict:
    """Submit, preempt whenever `next_delay(since_start)` says (None: no more), finish; figures."""
    job_id, run_dir = submit(work, overrides)
    poll(lambda: job_state(job_id) == "RUNNING", "the job to run", 300)
    first_start = started_at(job_id)
    preemptions = 0
    while True:
        delay = next_delay(preemptions)
        if delay is None:
            break
        this_start = started_at(job_id)
        while time.time() < this_start + delay and job_state(job_id) == "RUNNING":
            time.sleep(0.05)  # the moment is chosen in advance: a clock, not a condition
        if job_state(job_id) != "RUNNING":
            break
        if not preempt_and_restart(job_id):
            break
        preemptions += 1
    state = wait_done(job_id)
    interruptions = costs(read_jsonl(run_dir / TIMELINE))
    waited = sum(float(c.get("held_s") or 0) + float(c.get("queued_s") or 0) for c in interruptions)
    result = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}
    ended = max(float(row["time"]) for row in read_jsonl(run_dir / "steps.jsonl"))
    return {
        "job_id": job_id,
        "run_dir": run_dir,
        "state": state,
        "completed": result.get("status") == "completed",
        "preemptions": preemptions,
        "costs": interruptions,
        "goodput": goodput(run_dir, first_start, ended, 0.0),  # released at once: Slurm's 2-minute hold is not in the wall time, its rest is
        "goodput_beyond_hold": goodput(run_dir, first_start, ended, waited),
        "wall_s": ended - first_start,
        "waited_s": waited,
    }


def summarize(label: str, run: dict, reference: dict) -> dict:
    same_losses = losses(run["run_dir"]) == losses(reference["run_dir"])
    same_weights = weights_digest(run["run_dir"]) == weights_digest(reference["run_dir"])
    redone = [int(c["redone_steps"]) for c in run["costs"]]
    stretches = {}
    for key in STRETCHES:
        values = [float(c[key]) for c in run["costs"] if c.get(key) is not None]
        stretches[key] = round(statistics.median(values), 2) if values else None
    causes: dict[str, int] = {}
    for c in run["costs"]:
        causes[str(c["cause"])] = causes.get(str(c["cause"]), 0) + 1
    row = {
        "label": label,
        "completed": run["completed"],
        "preemptions": run["preemptions"],
        "costs_logged": len(run["costs"]),
        "identical_losses": same_losses,
        "identical_weights": same_weights,
        "max_redone_steps": max(redone, default=0),
        "redone_within_interval": all(r <= EVERY_STEPS for r in redone),
        "median_s": stretches,
        "causes": causes,
        "goodput": round(run["goodput"], 3),
        "reference_goodput": round(reference["goodput"], 3),
        "goodput_beyond_hold": round(run["goodput_beyond_hold"], 3),
        "job_goodput": round(job_goodput(reference["wall_s"], run["wall_s"], run["waited_s"]), 3),
        "waited_s": round(run["waited_s"], 1),
        "wall_s": round(run["wall_s"], 1),
        "reference_wall_s": round(reference["wall_s"], 1),
    }
    print(json.dumps(row), flush=True)
    return row


def markdown_row(row: dict) -> str:
    """One line of docs/reliability.md's table."""
    m = row["median_s"]
    shown = " / ".join("-" if m[key] is None else f"{m[key]:.1f}" for key in STRETCHES)
    same = "yes" if row["identical_losses"] and row["identical_weights"] else "NO"
    return (
        f"| {row['label']} | {row['preemptions']} | {'yes' if row['completed'] else 'NO'} | {same} | {row['max_redone_steps']} | {shown} | "
        f"{row['goodput']:.3f} ({row['reference_goodput']:.3f}) | {row['goodput_beyond_hold']:.3f} | **{row['job_goodput']:.3f}** | "
        f"{row['wall_s']:.0f} - {row['waited_s']:.0f} ({row['reference_wall_s']:.0f}) |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("random", "every"))
    parser.add_argument("--preemptions", type=int, default=20, help="random: preemptions per run (default 20)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="random: one run per seed of the moments (default 1 2 3)")
    parser.add_argument("--window", type=float, default=20.0, help="random: preempt within this many seconds of each start (default 20)")
    parser.add_argument("--period", type=float, nargs="+", default=[60.0], help="every: seconds between preemptions, one run each (default 60)")
    parser.add_argument("--epochs", type=int, default=60, help="the job's epochs (default 60)")
    args = parser.parse_args()
    if min(args.preemptions, args.epochs, *args.seeds, *(int(p) for p in args.period)) < 1 or args.window <= 0:
        parser.error("--preemptions, --epochs, --seeds, --period and --window must be positive")
    overrides = job_overrides(args.epochs)
    rows = []
    with tempfile.TemporaryDirectory() as ref_work:
        poll(nodes_settled, "an idle cluster", 300)
        reference = run_job(Path(ref_work), overrides, lambda n: None)
        print(f"uninterrupted: {reference['wall_s']:.1f} s, goodput {reference['goodput']:.3f}", flush=True)
        plans: list[tuple[str, Callable[[int], float | None]]] = []
        if args.mode == "random":
            for seed in args.seeds:
                rng = random.Random(seed)
                label = f"random moments, seed {seed}, window {args.window:.0f} s"
                plans.append((label, lambda n, rng=rng: rng.uniform(0, args.window) if n < args.preemptions else None))
        else:
            plans = [(f"every {period:.0f} s", lambda n, period=period: period) for period in args.period]
        for label, next_delay in plans:
            with tempfile.TemporaryDirectory() as work:
                poll(nodes_settled, "an idle cluster", 300)
                rows.append(summarize(label, run_job(Path(work), overrides, next_delay), reference))
    stretches = " / ".join(STRETCHES)
    goodputs = "steps' goodput (uninterrupted) | the same, hold and queue out | job's goodput | wall s - hold and queue (uninterrupted)"
    print(f"| run | preemptions | completed | bit-identical | max steps redone | median s: {stretches} | {goodputs} |")
    for row in rows:
        print(markdown_row(row))
    ok = all(r["completed"] and r["identical_losses"] and r["identical_weights"] and r["redone_within_interval"] for r in rows)
    print(f"{'all runs completed bit-identically' if ok else 'FAILED'}: {len(rows)} runs, {sum(r['preemptions'] for r in rows)} preemptions")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
