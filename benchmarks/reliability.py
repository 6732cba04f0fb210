#!/usr/bin/env python
"""Fault trials on local MPI ranks, repeated: what happened, how fast, and how much work was lost.

    python benchmarks/reliability.py [--trials 5] [--out docs/reliability-trials.md]

- stall:     SIGSTOP one of 3 ranks at a random step; the watchdog (5 s) must end the job; then
             the run dir is started again and must complete from its last checkpoint.
- nan-skip:  a NaN training sample (float32 HDF5): its steps are skipped, training completes.
- nan-roll:  the same with trainer.max_bad_steps=1: a rollback per hit, training completes.
- disk-full: the run dir on a 4 MiB tmpfs (root only): the save that does not fit fails in one
             line, the previous checkpoint loads, and after growing the disk the run completes.
- node-loss: on the simulated Slurm (scripts/slurm-sim.sh), everything on one node of a running
             2-node job is SIGKILLed, alternately its batch host and the other node: Slurm must
             requeue the job, which resumes on other nodes and completes; the node comes back.
Lost work = steps trained twice after a restart (at most the checkpoint interval, 5 steps).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collectives.mpirun import local_ranks_environment  # noqa: E402  (after the path)
from hpc.slurm import slurmctl  # noqa: E402

CHECKPOINT = ["checkpoint.every_steps=5", "checkpoint.every_minutes=null", "checkpoint.async_save=false"]


def launch(run_root: Path, *overrides: str, wait: bool = True) -> subprocess.Popen[str] | subprocess.CompletedProcess[str]:
    command = [sys.executable, str(ROOT / "launch.py"), *overrides, f"run_root={run_root}"]
    if wait:
        return subprocess.run(command, cwd=run_root.parent, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(command, cwd=run_root.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def the_run(run_root: Path) -> Path:
    (config,) = [p for p in run_root.glob("*/*/config.yaml")]
    return config.parent


def step_log(run_dir: Path) -> list[dict]:
    path = run_dir / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def resume(run_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**local_ranks_environment(os.environ), "PYTHONPATH": str(ROOT)}
    return subprocess.run(shlex.split((run_dir / "command.txt").read_text()), env=env, capture_output=True, text=True, timeout=600)


def lost_steps(run_dir: Path) -> int:
    """Steps logged more than once: trained again after a restart."""
    seen = [r["step"] for r in step_log(run_dir)]
    return len(seen) - len(set(seen))


def trial_stall(work: Path, rng: random.Random) -> dict:
    from benchmarks.simcluster import end_process

    run_root = work / "runs"
    proc = launch(
        run_root,
        "resources.tasks_per_node=3",
        "model.hidden_sizes=[1024,1024]",
        "trainer.max_steps=80",
        "trainer.epochs=100",
        "trainer.watchdog_s=5",
        *CHECKPOINT,
        wait=False,
    )
    target = rng.randint(8, 40)
    deadline = time.monotonic() + 120
    while not list(run_root.glob("*/*/steps.jsonl")) or len(step_log(the_run(run_root))) < target:
        if proc.poll() is not None or time.monotonic() > deadline:
            return {"outcome": "did not reach the stall step", "ok": False}
        time.sleep(0.01)
    run_dir = the_run(run_root)
    victim = json.loads((run_dir / "heartbeats" / "rank-00001.json").read_text())["pid"]
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        code = proc.wait(timeout=120)
    finally:
        end_process(victim)
    ended_s = time.monotonic() - stopped
    named = any("behind: rank 1 on" in log.read_text() for log in (run_dir / "logs").glob("rank-*.log"))
    again = resume(run_dir)
    result = json.loads((run_dir / "result.json").read_text()) if again.returncode == 0 else {}
    ok = code != 0 and named and result.get("status") == "completed"
    return {
        "outcome": f"aborted after {ended_s:.1f} s, stalled rank named: {named}, resumed and completed: {result.get('status') == 'completed'}",
        "seconds": ended_s,
        "lost": lost_steps(run_dir),
        "ok": ok,
    }


def poisoned_data(path: Path, rng: random.Random) -> Path:
    import h5py
    import numpy as np

    from trainers.config import DataConfig
    from trainers.data.datasets import default_dataset_path, resolve_data_path

    resolve_data_path(DataConfig())
    with h5py.File(default_dataset_path(), "r") as src, h5py.File(path, "w") as dst:
        for split in (name for name in ("train", "val", "test") if name in src):  # digits files before val/ hold test/
            x = src[f"{split}/x"][...].astype(np.float32) * float(src[f"{split}/x"].attrs["scale"])
            if split == "train":
                x[rng.randrange(len(x))] = np.nan
            dst[f"{split}/x"], dst[f"{split}/y"] = x, src[f"{split}/y"][...]
    return path


def trial_nan(work: Path, rng: random.Random, max_bad: int) -> dict:
    data = poisoned_data(work / "poisoned.h5", rng)
    done = launch(work / "runs", f"data.path={data}", "trainer.epochs=3", f"trainer.max_bad_steps={max_bad}", *CHECKPOINT)
    run_dir = the_run(work / "runs")
    records = step_log(run_dir)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["?"]
        return {"outcome": f"ended with an error: {last[0][:120]}", "ok": False, "lost": lost_steps(run_dir)}
    result = json.loads((run_dir / "result.json").read_text())
    skipped = sum(1 for r in records if r.get("skipped"))
    if "no committed checkpoint yet" in (run_dir / "logs" / "rank-00000.log").read_text():
        skipped_note = "; hit before the first checkpoint: went on without a rollback"
    else:
        skipped_note = ""
    accuracy = result["val_metrics"]["accuracy"]
    return {
        "outcome": f"completed; {skipped} steps skipped, {records[-1]['rollbacks']} rollbacks, final val accuracy {accuracy:.3f}{skipped_note}",
        "ok": True,
        "lost": lost_steps(run_dir),
    }


def trial_disk_full(work: Path, rng: random.Random) -> dict:
    disk = work / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode != 0:
        return {"outcome": "skipped: needs root for a tmpfs", "ok": False}
    try:
        first = launch(disk / "runs", "model.hidden_sizes=[512,512]", f"trainer.epochs={rng.randint(2, 3)}", *CHECKPOINT)
        run_dir = the_run(disk / "runs")
        log = (run_dir / "logs" / "rank-00000.log").read_text()
        clean = first.returncode != 0 and "No space left on device; the previous committed checkpoint is intact" in log and "Traceback" not in log
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        again = resume(run_dir)
        result = json.loads((run_dir / "result.json").read_text()) if again.returncode == 0 else {}
        return {
            "outcome": f"one-line error: {clean}; resumed from step {result.get('resumed_from')} and completed: {result.get('status') == 'completed'}",
            "ok": clean and result.get("status") == "completed",
            "lost": lost_steps(run_dir),
        }
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


BATCH_HOST_NEXT = itertools.cycle([True, False])  # node-loss trials alternate the node they lose


def trial_node_loss(work: Path, rng: random.Random) -> dict:
    from benchmarks.simcluster import lose_a_node, newest_committed_step, parse_job_id

    run_root = work / "runs"
    submitted = launch(
        run_root, "cluster=simulated", "resources.nodes=2", "resources.tasks_per_node=2", "model.hidden_sizes=[1024,1024]", "trainer.epochs=4", *CHECKPOINT
    )
    if submitted.returncode != 0:
        return {"outcome": f"not submitted: {submitted.stderr.strip()[-200:]}", "ok": False}
    job_id = parse_job_id(submitted.stdout)
    target = rng.randint(8, 30)
    deadline = time.monotonic() + 180
    while not list(run_root.glob("*/*/steps.jsonl")) or len(step_log(the_run(run_root))) < target:
        if time.monotonic() > deadline:
            slurmctl.cancel(job_id)
            return {"outcome": "did not reach the step to fail at", "ok": False}
        time.sleep(0.05)
    run_dir = the_run(run_root)
    committed = newest_committed_step(run_dir)
    loss = lose_a_node(job_id, batch_host=next(BATCH_HOST_NEXT))
    deadline = time.monotonic() + 300
    while not (run_dir / "result.json").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    result = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}
    ok = result.get("status") == "completed" and loss.lost not in loss.second_nodes and result.get("resumed_from", -1) >= committed
    where = "batch host" if loss.was_batch_host else "other node"
    return {
        "outcome": f"{where} {loss.lost} lost at step {target}: requeued after {loss.requeued_s:.0f} s, DOWN after {loss.down_s:.0f} s, "
        f"ran again on {','.join(loss.second_nodes)}, resumed from step {result.get('resumed_from')} "
        f"(newest committed before: {committed}), completed: {result.get('status') == 'completed'}",
        "seconds": loss.requeued_s,
        "timing": "requeued after",
        "lost": lost_steps(run_dir),
        "ok": ok,
    }


TRIALS = {
    "stall": trial_stall,
    "nan-skip": lambda w, r: trial_nan(w, r, 3),
    "nan-roll": lambda w, r: trial_nan(w, r, 1),
    "disk-full": trial_disk_full,
    "node-loss": trial_node_loss,
}


def merged_table(path: Path, rows: list[str], trials: int) -> str:
    """The trials file with this run's table rows in place of those of the same fault; the rest
    of the file (notes, the per-trial lines pasted from stdout) is kept, so `--only` adds one kind."""

    def fault(line: str) -> str:
        return line.split("|")[1].strip() if line.startswith("| ") else ""

    lines = path.read_text().splitlines() if path.exists() else []
    if rows[0] not in lines:
        return f"<!-- written by: python benchmarks/reliability.py --trials {trials} [--only NAME] -->\n" + "\n".join(rows) + "\n"
    table_end = lines.index(rows[0]) + 2
    while table_end < len(lines) and lines[table_end].startswith("| "):
        table_end += 1
    fresh = {fault(row): row for row in rows[2:]}
    old = {fault(line): line for line in lines[lines.index(rows[0]) + 2 : table_end]}
    merged = [(old | fresh)[name] for name in TRIALS if name in old | fresh]
    return "\n".join(lines[: lines.index(rows[0]) + 2] + merged + lines[table_end:]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--only", choices=sorted(TRIALS), action="append")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability-trials.md")
    args = parser.parse_args()
    rng = random.Random(2026)
    rows = ["| fault | trials | as expected | outcomes | lost steps (max) |", "|---|---:|---:|---|---:|"]
    for name in args.only or list(TRIALS):
        results = []
        for index in range(args.trials):
            with tempfile.TemporaryDirectory(prefix=f"reliability-{name}-") as tmp:
                outcome = TRIALS[name](Path(tmp), rng)
            print(f"{name} #{index + 1}: {outcome['outcome']} (lost steps: {outcome.get('lost', '-')})", flush=True)
            results.append(outcome)
        times = [r["seconds"] for r in results if "seconds" in r]
        timing = f"; {results[0].get('timing', 'abort after')} {min(times):.1f}-{max(times):.1f} s" if times else ""
        rows.append(
            f"| {name} | {len(results)} | {sum(r['ok'] for r in results)} | {results[0]['outcome']}{timing} | {max(r.get('lost', 0) for r in results)} |"
        )
    print("\n".join(rows))
    args.out.write_text(merged_table(args.out, rows, args.trials))
    return 0


if __name__ == "__main__":
    sys.exit(main())
