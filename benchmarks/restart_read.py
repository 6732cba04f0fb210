"""A restart's read of the newest checkpoint: from the nodes' memory (trainers.checkpoint.restart)
against the store's path (Checkpointer.load_latest: every piece verified, then read), side by
side in one run, with the page cache dropped before each read (as after a node's restart, or a
shared file system whose other clients evicted it).

    python -m benchmarks.restart_read [--mb 64] [--own-mb 128] [--ranks 2] [--rounds 5] [--dir DIR]

--mb: the shared file's size (rank 0's: replicated weights and optimizer state); --own-mb: each
rank's own file (its shard of sharded state: ZeRO, FSDP; replicated training's are kilobytes).
Ranks are threads of one process (collectives.testing.ThreadWorld), each on a node of its own
(a memory directory under /dev/shm); the store is a directory on --dir's disk. Needs root to drop the page
cache (/proc/sys/vm/drop_caches); without it the store's read is a warm one and says so. Medians
over interleaved rounds; the bounds beside them: the disk's sequential read of the checkpoint's
files (cold), and a copy of the same bytes in memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from collectives.testing import ThreadWorld
from hpc.env import checkpoint_memory
from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.memory import MemoryCopies
from trainers.checkpoint.restart import load_held
from trainers.checkpoint.storage import LocalStore


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def saved(store: LocalStore, memories: list[MemoryCopies], megabytes: int, own_megabytes: int) -> None:
    """The shared piece (rank 0's) and each rank's own, saved asynchronously and committed, as training does."""
    ranks = len(memories)
    checkpointers = [Checkpointer(store, rank, ranks, keep=2, memory=memories[rank]) for rank in range(ranks)]
    for rank, ckpt in enumerate(checkpointers):
        shared = {"state": torch.randn(megabytes * (1 << 20) // 4)} if rank == 0 else None
        ckpt.begin_save(1, shared, {"rng": torch.get_rng_state(), "shard": torch.randn(own_megabytes * (1 << 20) // 4)}, asynchronous=True)
    for ckpt in checkpointers:
        ckpt.wait_written()
    for ckpt in reversed(checkpointers):
        ckpt.commit()


def timed_read(store: LocalStore, memories: list[MemoryCopies | None]) -> float:
    def read(comm) -> float:  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        ckpt = Checkpointer(store, comm.rank, comm.world_size, keep=2, memory=memories[comm.rank])
        loaded = load_held(ckpt, comm) if memories[comm.rank] is not None else ckpt.load_latest()
        assert loaded is not None and loaded[0] == 1
        return time.perf_counter() - started

    return max(ThreadWorld(len(memories)).run(read))  # the restart waits for its slowest rank


def raw_read(paths: list[Path]) -> float:
    started = time.perf_counter()
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restart_read", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=64, help="the shared file's size (MiB)")
    parser.add_argument("--own-mb", type=int, default=128, help="each rank's own file's size (MiB): its shard")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the store lives (default: a temporary directory)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="restart-read-", dir=args.dir))
    shm = checkpoint_memory(f"bench-{os.getpid()}")
    try:
        store = LocalStore(work / "checkpoints")
        memories = [MemoryCopies(shm / f"node{rank}", store.url) for rank in range(args.ranks)]
        saved(store, memories, args.mb, args.own_mb)
        files = sorted((work / "checkpoints").glob("step-*/*.ckpt"))
        timings: dict[str, list[float]] = {"store": [], "memory": [], "disk bound": [], "memory bound": []}
        cold = True
        for _ in range(args.rounds):
            cold = drop_page_cache() and cold
            timings["store"].append(timed_read(store, [None] * args.ranks))
            cold = drop_page_cache() and cold
            timings["memory"].append(timed_read(store, list(memories)))
            cold = drop_page_cache() and cold
            timings["disk bound"].append(raw_read(files))
            held = [p for m in memories for p in m.root.rglob("*.ckpt")]
            timings["memory bound"].append(raw_read(held))
        medians = {name: statistics.median(values) for name, values in timings.items()}
        cache = "dropped" if cold else "NOT dropped (not root)"
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
