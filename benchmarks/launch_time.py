"""From the command to a job id: `python launch.py cluster=simulated hold=true` against a plain
submitit submission of a trivial function to the same partition, interleaved, held jobs
(cancelled after each run, so the queue never fills). Then where launch.py's time goes:
`python -X importtime` of the same command, the largest imports by cumulative time.

    scripts/slurm-sim.sh start
    python benchmarks/launch_time.py [--runs 7] [--top 12]

Each figure is the wall time of the whole process (interpreter start to exit; the job id is
its last line), median (min-max) over the runs.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.simcluster import parse_job_id  # noqa: E402
from hpc.slurm.slurmctl import cancel  # noqa: E402

PLAIN_SUBMITIT = """
import sys, submitit
executor = submitit.AutoExecutor(folder=sys.argv[1], cluster="slurm")
executor.update_parameters(slurm_partition="debug", timeout_min=5, slurm_additional_parameters={"hold": True})
print("submitted job", executor.submit(print, "hello").job_id)
"""


def launch_command(run_root: Path) -> list[str]:
    return [sys.executable, str(ROOT / "launch.py"), "cluster=simulated", "hold=true", f"run_root={run_root}"]


def timed(command: list[str]) -> tuple[float, str]:
    """(wall seconds, the job id printed)."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"error: {command[1]} failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
    return elapsed, parse_job_id(done.stdout)


def cumulative_imports(stderr: str, top: int) -> list[tuple[float, str]]:
    """The top-level imports (not their children) with the largest cumulative time, in seconds."""
    rows = []
    for line in stderr.splitlines():
        found = re.match(r"import time:\s+\d+\s+\|\s+(\d+)\s+\| ( *)(\S+)", line)
        if found and not found.group(2):  # no indent: imported by the program itself
            rows.append((int(found.group(1)) / 1e6, found.group(3)))
    return sorted(rows, reverse=True)[:top]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="runs of each, interleaved")
    parser.add_argument("--top", type=int, default=12, help="imports listed")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    times: dict[str, list[float]] = {"launch.py": [], "plain submitit": []}
    with tempfile.TemporaryDirectory(prefix="launch-time-") as scratch:
        jobs = []
        try:
            for run in range(args.runs):
                order = [
                    ("launch.py", launch_command(Path(scratch) / "runs")),
                    ("plain submitit", [sys.executable, "-c", PLAIN_SUBMITIT, str(Path(scratch) / "submitit")]),
                ]
                for name, command in order if run % 2 == 0 else order[::-1]:
                    seconds, job_id = timed(command)
                    times[name].append(seconds)
                    jobs.append(job_id)
                    cancel(job_id)
            profile = subprocess.run(
                [sys.executable, "-X", "importtime", *launch_command(Path(scratch) / "runs")[1:]], capture_output=True, text=True, cwd=ROOT
            )
            jobs.append(parse_job_id(profile.stdout))
        finally:
            for job_id in jobs:
                cancel(job_id)
    print(f"## to a job id, {args.runs} runs each, interleaved (seconds, median (min-max))\n")
    print("| command | wall s |\n| --- | --- |")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) |")
    ratio = statistics.median(times["launch.py"]) / statistics.median(times["plain submitit"])
    print(f"\nlaunch.py / plain submitit: {ratio:.2f}x\n")
    print("## launch.py's largest imports (cumulative, python -X importtime)\n")
    print("| module | s |\n| --- | --- |")
    for seconds, module in cumulative_imports(profile.stderr, args.top):
        print(f"| {module} | {seconds:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
