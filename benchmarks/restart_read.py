"""A restart's read of the newest checkpoint: from the nodes' memory (trainers.checkpoint.restart)
against the store's path (Checkpointer.load_latest: every piece verified, then read), side by
side in one run, with the page cache dropped before each read (as after a node's restart, or a
shared file system whose other clients evicted it).

    python -m benchmarks.restart_read [--mb 64] [--own-mb 128] [--ranks 2] [--rounds 5] [--dir DIR]

--mb: the shared file's size (rank 0's: replicated weights and optimizer state); --own-mb: each
rank's own file (its shard of sharded state: ZeRO, FSDP; replicated training's are kilobytes).
Ranks are mpirun's, each on a node of its own (a memory directory under /dev/shm); the store is
a directory on --dir's disk. Needs root to drop the page
cache (/proc/sys/vm/drop_caches); without it the store's read is a warm one and says so. Medians
over interleaved rounds; the bounds beside them: the disk's sequential read of the checkpoint's
files (cold), and a copy of the same bytes in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hpc.env import checkpoint_memory
from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.layout import SHARED, rank_files, step_dir_name
from trainers.checkpoint.memory import MemoryCopies
from trainers.checkpoint.restart import load_held
from trainers.checkpoint.storage import LocalStore

ROOT = Path(__file__).resolve().parent.parent


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def timed_read(store: LocalStore, memory: MemoryCopies | None, comm: Any) -> float:
    """Seconds until every rank has its pieces (the restart waits for its slowest rank)."""
    comm.barrier()
    started = time.perf_counter()
    ckpt = Checkpointer(store, comm.rank, comm.world_size, keep=2, memory=memory)
    loaded = load_held(ckpt, comm) if memory is not None else ckpt.load_latest()
    assert loaded is not None and loaded[0] == 1
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    comm.allreduce_(elapsed, op="max")
    return float(elapsed[0])


def raw_read(paths: list[Path]) -> float:
    started = time.perf_counter()
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
    return time.perf_counter() - started


def worker(args: argparse.Namespace) -> None:
    """One rank under mpirun: save, then time the reads, rank 0 dropping the page cache between."""
    from collectives.mpi import MpiCollectives

    comm = MpiCollectives.from_world()
    store = LocalStore(args.dir / "checkpoints")
    memory = MemoryCopies(args.shm / f"node{comm.rank}", store.url)
    mine = Checkpointer(store, comm.rank, comm.world_size, keep=2, memory=memory)
    shared = {"state": torch.randn(args.mb * (1 << 20) // 4)} if comm.rank == 0 else None
    mine.begin_save(1, shared, {"rng": torch.get_rng_state(), "shard": torch.randn(args.own_mb * (1 << 20) // 4)}, asynchronous=True)
    mine.wait_written()
    comm.barrier()
    mine.commit()  # rank 0 publishes; the others keep their copy
    comm.barrier()
    step_dir = store.root / step_dir_name(1)
    timings: dict[str, list[float]] = {"store": [], "memory": [], "disk bound": [], "memory bound": []}
    cold = True

    def dropped() -> bool:
        comm.barrier()
        done = torch.tensor([1.0 if comm.rank != 0 or drop_page_cache() else 0.0], dtype=torch.float64)
        comm.allreduce_(done, op="min")
        return bool(done[0])

    for _ in range(args.rounds):
        cold = dropped() and cold
        timings["store"].append(timed_read(store, None, comm))
        cold = dropped() and cold
        timings["memory"].append(timed_read(store, memory, comm))
        cold = dropped() and cold
        if comm.rank == 0:  # the bounds: every file's read, once
            timings["disk bound"].append(raw_read([step_dir / SHARED, *rank_files(step_dir)]))
            timings["memory bound"].append(raw_read(list(args.shm.rglob("*.ckpt"))))
    if comm.rank == 0:
        print(json.dumps({"cold": cold, "timings": timings}), flush=True)
    comm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restart_read", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=64, help="the shared file's size (MiB)")
    parser.add_argument("--own-mb", type=int, default=128, help="each rank's own file's size (MiB): its shard")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the store lives (default: a temporary directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shm", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from collectives.mpirun import mpirun_command, root_environment

    work = Path(tempfile.mkdtemp(prefix="restart-read-", dir=args.dir))
    shm = checkpoint_memory(f"bench-{os.getpid()}")
    try:
        command = mpirun_command(args.ranks, [sys.executable, "-m", "benchmarks.restart_read", "--worker", "--dir", str(work), "--shm", str(shm)])
        command += ["--mb", str(args.mb), "--own-mb", str(args.own_mb), "--rounds", str(args.rounds)]
        env = {**os.environ, **root_environment(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"the ranks failed: {done.stderr[-1500:]}")
        report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
        timings = report["timings"]
        medians = {name: statistics.median(values) for name, values in timings.items()}
        cache = "dropped" if report["cold"] else "NOT dropped (not root)"
        print(f"restart read, {args.mb} MiB shared + {args.own_mb} MiB own a rank, {args.ranks} ranks, {args.rounds} rounds, page cache {cache}")
        for name, values in timings.items():
            print(f"  {name:12s} {medians[name]:6.3f} s  ({min(values):.3f}-{max(values):.3f})")
        print(f"  memory / store: {medians['memory'] / medians['store']:.3f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
