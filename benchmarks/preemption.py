"""Time from a preemption signal to a committed checkpoint and a requeued job, on a real Slurm.

    python benchmarks/preemption.py [--repeats 3] [overrides...]

Submits a 2-node x 2-rank job with launch.py (cluster=simulated unless overridden), waits until
it has trained 10 steps, sends `scancel --signal=USR1` (what preempt_send_user_signal delivers)
and measures, from the signal: the commit of the on-signal checkpoint (rank 0's log) and the
moment Slurm counts the job as restarted. Cancels the job afterwards.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.simcluster import parse_job_id, restarts  # noqa: E402  (after the path)
from hpc.slurm import slurmctl  # noqa: E402

DEFAULTS = [
    "cluster=simulated",
    "resources.nodes=2",
    "resources.tasks_per_node=2",
    "model.hidden_sizes=[1024,1024]",
    "trainer.epochs=50",
    "checkpoint.every_minutes=null",
]


def wait_for(condition, timeout_s: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.02)  # polling files and scontrol: there is no event to wait on


def log_time(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def measure_once(overrides: list[str], workdir: Path) -> tuple[float, float]:
    run_root = workdir / f"r{time.monotonic_ns()}"
    out = subprocess.run([sys.executable, str(ROOT / "launch.py"), *overrides, f"run_root={run_root}"], capture_output=True, text=True, check=True).stdout
    job_id = parse_job_id(out)
    (run_dir,) = [p.parent for p in run_root.glob("*/*/config.yaml")]
    steps = run_dir / "steps.jsonl"
    try:
        wait_for(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 10)
        signalled = time.time()
        error = slurmctl.cancel(job_id, signal="USR1")
        if error:
            raise RuntimeError(f"scancel --signal=USR1 {job_id}: {error}")
        wait_for(lambda: restarts(job_id) >= 1)
        requeued = time.time()
        log = (run_dir / "logs" / "rank-00000.log").read_text().splitlines()
        committed = [log_time(line) for line in log if "committed" in line and log_time(line) >= signalled - 1]
        return committed[0] - signalled, requeued - signalled
    finally:
        slurmctl.cancel(job_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    commits, requeues = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            commit_s, requeue_s = measure_once([*DEFAULTS, *args.overrides], Path(tmp))
            commits.append(commit_s)
            requeues.append(requeue_s)
    print("| figure | median (min-max) |")
    print("| --- | --- |")
    print(f"| signal -> on-signal checkpoint committed | {statistics.median(commits):.2f} s ({min(commits):.2f}-{max(commits):.2f}) |")
    print(f"| signal -> job requeued (Slurm Restarts+1) | {statistics.median(requeues):.2f} s ({min(requeues):.2f}-{max(requeues):.2f}) |")


if __name__ == "__main__":
    main()
