"""Measure the embedded default job: accuracy, samples/s and wall time, side by side by rank count.

    python benchmarks/default_job.py [--repeats 3] [--ranks 1 2 3] [--write docs/benchmarks.md]

Each configuration runs `python launch.py resources.tasks_per_node=N` `repeats` times,
interleaved (1,2,3,1,2,3,...) so machine noise hits all of them alike; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(ranks: int, workdir: Path) -> dict[str, float]:
    run_root = workdir / f"r{ranks}-{time.monotonic_ns()}"
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), f"resources.tasks_per_node={ranks}", f"run_root={run_root}"],
        capture_output=True, text=True, check=True,
    )
    wall = time.perf_counter() - started
    (summary_path,) = run_root.glob("*/*/result.json")
    summary = json.loads(summary_path.read_text())
    metrics = [json.loads(line) for line in (summary_path.parent / "metrics.jsonl").read_text().splitlines()]
    steady = statistics.median(m["samples_per_s"] for m in metrics[1:])  # epoch 1 includes warm-up
    return {"accuracy": summary["test_accuracy"], "samples_per_s": steady, "train_s": summary["train_seconds"], "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--write", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in args.ranks}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for ranks in args.ranks:
                runs[ranks].append(run_once(ranks, Path(tmp)))
    base = statistics.median(r["samples_per_s"] for r in runs[args.ranks[0]])
    rows = ["| ranks | test accuracy (min-max) | samples/s (median epoch) | vs %d rank(s) | train s | launch.py wall s |" % args.ranks[0],
            "| --- | --- | --- | --- | --- | --- |"]
    for ranks, results in runs.items():
        med = {key: statistics.median(r[key] for r in results) for key in results[0]}
        accs = [r["accuracy"] for r in results]
        rows.append(f"| {ranks} | {med['accuracy']:.4f} ({min(accs):.4f}-{max(accs):.4f}) | {med['samples_per_s']:,.0f} | "
                    f"{med['samples_per_s'] / base:.2f}x | {med['train_s']:.2f} | {med['wall_s']:.1f} |")
    table = "\n".join(rows)
    print(table)
    if args.write:
        header = (f"\n### Embedded default job ({date.today().isoformat()}, {platform.node()}, {platform.processor() or platform.machine()}, "
                  f"{os.cpu_count()} cores)\n\n`python benchmarks/default_job.py --repeats {args.repeats} --ranks {' '.join(map(str, args.ranks))}`"
                  f" ({args.repeats} runs each, interleaved; medians)\n\n")
        with args.write.open("a") as f:
            f.write(header + table + "\n")


if __name__ == "__main__":
    main()
