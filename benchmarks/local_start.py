"""A local job's cost with its ranks forked from one warm process (`cluster.warm_ranks`, the
default) against each rank its own interpreter (`cluster.warm_ranks=false`): the embedded
default job for a few steps, on N ranks, the two interleaved.

    python benchmarks/local_start.py [--ranks 2 3] [--rounds 5] [--steps 5]
    python benchmarks/local_start.py --frameworks [--ranks 2] [--rounds 3]

--frameworks: the examples' Lightning and Hugging Face Trainer scripts instead, their frameworks
imported by the warm process once (what launch.py has it do, HPCTK_WARM_IMPORTS) against by each
rank after the fork (the variable emptied); warm ranks both ways.

Each figure is one whole launch.py (interpreter start to exit): its wall time and the CPU of it
and every process under it (mpirun, the warm process, the ranks), median (min-max) over the
rounds. On a machine with a core free per rank the ranks' imports run side by side; where they
are fewer (CI's 2 cores, two test workers) the CPU is the time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# --frameworks: each example's launch.py arguments, a few steps
EXAMPLES = {
    "lightning": [f"script={ROOT / 'examples' / 'lightning' / 'train.py'}", "--", "--max-steps", "10", "--val-every", "10"],
    "hf_trainer": [f"script={ROOT / 'examples' / 'hf_trainer' / 'train.py'}", "--", "--max-steps", "10", "--train-size", "160"],
}


def one_launch(run_root: Path, ranks: int, steps: int, warm: bool) -> tuple[float, float]:
    """(wall s, CPU s) of one launch.py, the processes under it included."""
    return timed_launch([f"run_root={run_root}", f"resources.tasks_per_node={ranks}", f"trainer.max_steps={steps}", f"cluster.warm_ranks={str(warm).lower()}"])


def framework_launch(run_root: Path, ranks: int, example: str, warm_imports: bool) -> tuple[float, float]:
    """One launch.py of `example`, its frameworks imported by the warm process or by each rank."""
    per_rank = [] if warm_imports else ["+cluster.env.HPCTK_WARM_IMPORTS="]
    return timed_launch([f"run_root={run_root}", f"resources.tasks_per_node={ranks}", *per_rank, *EXAMPLES[example]])


def timed_launch(arguments: list[str]) -> tuple[float, float]:
    command = [sys.executable, str(ROOT / "launch.py"), *arguments]
    before, began = os.times(), time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, after = time.perf_counter() - began, os.times()
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def shown(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--frameworks", action="store_true", help="the Lightning and Hugging Face examples: frameworks imported once or per rank")
    args = parser.parse_args()
    if args.frameworks:
        return frameworks_table(args.ranks[0], args.rounds)
    print(f"| ranks | warm: wall s | warm: CPU s | cold: wall s | cold: CPU s | wall warm/cold | CPU warm/cold |  ({os.cpu_count()} cores)")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="local-start-") as scratch:
        for ranks in args.ranks:
            figures: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            one_launch(Path(scratch), ranks, args.steps, True)  # the page cache and auto's tuning table, for both
            for _ in range(args.rounds):
                for warm in (True, False):
                    figures[warm].append(one_launch(Path(scratch), ranks, args.steps, warm))
            walls = {warm: [w for w, _ in runs] for warm, runs in figures.items()}
            cpus = {warm: [c for _, c in runs] for warm, runs in figures.items()}
            ratio_wall = statistics.median(walls[True]) / statistics.median(walls[False])
            ratio_cpu = statistics.median(cpus[True]) / statistics.median(cpus[False])
            cells = [shown(walls[True]), shown(cpus[True]), shown(walls[False]), shown(cpus[False]), f"{ratio_wall:.2f}", f"{ratio_cpu:.2f}"]
            print(f"| {ranks} | {' | '.join(cells)} |")
    return 0


def frameworks_table(ranks: int, rounds: int) -> int:
    columns = "once: wall s | once: CPU s | per rank: wall s | per rank: CPU s | wall once/per rank | CPU once/per rank"
    print(f"| example, {ranks} ranks | {columns} |  ({os.cpu_count()} cores)")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="local-start-") as scratch:
        for example in EXAMPLES:
            figures: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            framework_launch(Path(scratch), ranks, example, True)  # the page cache, for both
            for _ in range(rounds):
                for once in (True, False):
                    figures[once].append(framework_launch(Path(scratch), ranks, example, once))
            walls = {once: [w for w, _ in runs] for once, runs in figures.items()}
            cpus = {once: [c for _, c in runs] for once, runs in figures.items()}
            ratios = [statistics.median(walls[True]) / statistics.median(walls[False]), statistics.median(cpus[True]) / statistics.median(cpus[False])]
            cells = [shown(walls[True]), shown(cpus[True]), shown(walls[False]), shown(cpus[False]), *(f"{r:.2f}" for r in ratios)]
            print(f"| {example} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
