"""A local job's cost with its ranks forked from one warm process (`cluster.warm_ranks`, the
default) against each rank its own interpreter (`cluster.warm_ranks=false`): the embedded
default job for a few steps, on N ranks, the two interleaved.

    python benchmarks/local_start.py [--ranks 2 3] [--rounds 5] [--steps 5]

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


def one_launch(run_root: Path, ranks: int, steps: int, warm: bool) -> tuple[float, float]:
    """(wall s, CPU s) of one launch.py, the processes under it included."""
    command = [
        *(sys.executable, str(ROOT / "launch.py"), f"run_root={run_root}"),
        *(f"resources.tasks_per_node={ranks}", f"trainer.max_steps={steps}", f"cluster.warm_ranks={str(warm).lower()}"),
    ]
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
