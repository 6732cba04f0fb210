"""How often auto's tuning pass agrees with itself: measure_table repeated on the same ranks with
two settings, interleaved (2 rounds with 1 untimed call per block, the default; 4 rounds with 2,
tried and not adopted), and at each size the algorithm each repeat would choose.

    mpirun -n 2 python benchmarks/tuning_stability.py [--repeats 8] [--sizes 4M,16M,64M]

Prints one line per repeat (each candidate's time as a fraction of MPI_Allreduce's, and the
choice), then per setting and size how many repeats chose the most frequent algorithm.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectives.bench import parse_size  # noqa: E402
from collectives.bench_report import human  # noqa: E402
from collectives.mpi import MpiCollectives  # noqa: E402

SETTINGS = ((2, 1), (4, 2))  # (rounds, untimed calls per block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--sizes", default="4M,16M,64M", help="bytes per rank, comma-separated")
    args = parser.parse_args()
    sizes = tuple(parse_size(text) for text in args.sizes.split(","))
    engine = MpiCollectives.from_world()
    candidates = engine.candidates()
    chosen: dict[tuple[int, int], list[list[str]]] = collections.defaultdict(list)
    for repeat in range(args.repeats):
        for rounds, warmup in SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]:  # drift hits both alike
            table = engine.measure("stability", sizes, rounds=rounds, warmup=warmup)
            choices = [str(table.fastest(n, candidates)) for n in sizes]  # auto's own rule
            chosen[rounds, warmup].append(choices)
            if engine.rank == 0:
                ratios = ["/".join(f"{c}={table.seconds[c][i] / table.seconds['mpi'][i]:.2f}" for c in candidates if c != "mpi") for i in range(len(sizes))]
                cells = [f"{human(n)} {ratio} -> {choice}" for n, ratio, choice in zip(sizes, ratios, choices, strict=True)]
                print(f"{rounds} rounds, {warmup} untimed: {table.tuned_in_s:.2f} s | " + " | ".join(cells), flush=True)
    if engine.rank == 0:
        for (rounds, warmup), runs in chosen.items():
            agree = [collections.Counter(run[i] for run in runs).most_common(1)[0] for i in range(len(sizes))]
            summary = ", ".join(f"{human(n)} {name} in {count} of {len(runs)}" for n, (name, count) in zip(sizes, agree, strict=True))
            print(f"{engine.world_size} ranks, {rounds} rounds, {warmup} untimed: {summary}")
    engine.close()


if __name__ == "__main__":
    main()
