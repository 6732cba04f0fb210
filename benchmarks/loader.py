"""The data loader against torch's DataLoader on ImageNet-shaped data (3 x 224 x 224 uint8),
written by the converter (`python -m trainers.convert numpy`) as ~1 GiB shards.

    python benchmarks/loader.py [--images 12000] [--batch 256] [--workers 1] [--rounds 3]

Loaders, each reading the same batches (the sampler's order for one rank), in interleaved rounds:
- ours: `data.workers=W` (trainers.data.loader: rows pread into shared slots, in order)
- ours, thread: `data.workers=0` (one prefetch thread in the rank)
- DataLoader, same reader: torch's DataLoader, W workers, over the same data set (H5Split,
  `__getitems__` per batch): the same reads, torch's worker and transfer machinery
- DataLoader, h5py per image: the data set users usually write (one h5py read per image,
  the file opened in each worker, default collate)

Two regimes:
- page cache: the files read once beforehand; images/s (wall) and images per CPU second of
  all the loader's processes (rank + workers): per loader core, the figure to set against a
  GPU's step rate (about 4,007 images/s for a bf16 ResNet-50 on an H100);
- cache dropped (posix_fadvise DONTNEED on every shard before each run): images/s as a fraction
  of the file system's raw sequential read of the same files (8 MiB reads), its physical bound.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from trainers import data as data_module  # noqa: E402
from trainers.data.loader import WorkerLoader  # noqa: E402
from trainers.data.reading import H5Split, Prefetcher  # noqa: E402
from trainers.data.sampler import ShardSampler  # noqa: E402
from trainers.task import read_items  # noqa: E402

SHAPE = (3, 224, 224)
TICKS = os.sysconf("SC_CLK_TCK")


def make_shards(directory: Path, images: int) -> list[Path]:
    """Random ImageNet-shaped arrays -> the converter -> shards (kept for later runs)."""
    shards = directory / "shards"
    if not shards.exists():
        directory.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        x = np.lib.format.open_memmap(directory / "x.npy", mode="w+", dtype=np.uint8, shape=(images, *SHAPE))
        for start in range(0, images, 1024):
            x[start : start + 1024] = rng.integers(0, 256, (min(1024, images - start), *SHAPE), dtype=np.uint8)
        x.flush()
        del x
        np.save(directory / "y.npy", rng.integers(0, 1000, images))
        np.save(directory / "tx.npy", rng.integers(0, 256, (256, *SHAPE), dtype=np.uint8))
        np.save(directory / "ty.npy", rng.integers(0, 1000, 256))
        arrays = [f"--{flag}={directory / name}.npy" for flag, name in (("x", "x"), ("y", "y"), ("val-x", "tx"), ("val-y", "ty"))]
        subprocess.run([sys.executable, "-m", "trainers.convert", "numpy", *arrays, f"--out={shards}"], check=True, cwd=ROOT)
        for name in ("x", "y", "tx", "ty"):
            (directory / f"{name}.npy").unlink()
    return sorted(shards.glob("train-*.h5"))


class PerImageH5:
    """The usual user data set: one h5py read per image, files opened lazily in each worker."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self.rows = [h5py.File(f, "r")["train/y"].shape[0] for f in files]
        self.starts = np.cumsum([0, *self.rows])
        self._opened: list[Any] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self._opened is None:
            self._opened = [h5py.File(f, "r") for f in self.files]
        shard = int(np.searchsorted(self.starts, index, side="right") - 1)
        f = self._opened[shard]
        local = index - int(self.starts[shard])
        return torch.from_numpy(f["train/x"][local]), int(f["train/y"][local])


def first(batch: Any) -> Any:
    return batch[0] if isinstance(batch, list) else batch


class CpuClock:
    """CPU seconds used by a set of processes since the clock started; a process's last reading
    is kept once it exits (torch's DataLoader ends its workers as the last batch arrives)."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self._pids, self._seen = pids, {}
        self._start = {pid: used for pid, used in self._read().items()}
        self._own = time.process_time()

    def _read(self) -> dict[int, float]:
        readings = {}
        for pid in self._pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            readings[pid] = (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
        return readings

    def tick(self) -> None:
        self._seen.update(self._read())

    def elapsed(self) -> float:
        self.tick()
        return sum(used - self._start.get(pid, 0.0) for pid, used in self._seen.items()) + time.process_time() - self._own


def run_loader(name: str, files: list[Path], batches: list[np.ndarray], workers: int, batch: int, prefetch: int) -> tuple[float, float]:
    """(images/s, images per CPU second of the rank and its workers) over `batches`, timed
    from the first batch received (worker start-up excluded) to the last."""
    split = H5Split(files, "train/x", "train/y")
    pids: Callable[[], list[int]]
    closer: Callable[[], None]
    if name == "ours":
        loader = WorkerLoader(split, workers, batch, prefetch=prefetch)
        source: Iterator[Any] = iter(loader.epoch(iter(batches)))
        pids, closer = (lambda: [p.pid for p in loader._processes]), loader.close
    elif name == "ours-thread":
        prefetcher = Prefetcher(lambda rows: read_items(split, rows), iter(batches), depth=prefetch)
        source, pids, closer = iter(prefetcher), (lambda: []), prefetcher.close
    else:
        dataset: Any = split if name == "dataloader" else PerImageH5(files)
        sampler = [b.tolist() for b in batches]
        collate = first if name == "dataloader" else None
        loader_kw: dict[str, Any] = {"collate_fn": collate} if collate else {}
        torch_loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers, prefetch_factor=prefetch, **loader_kw)
        it = iter(torch_loader)
        source = it
        pids, closer = (lambda: [w.pid for w in it._workers]), (lambda: it._shutdown_workers())  # type: ignore[attr-defined]
    try:
        next(source)  # start-up and the first batch are not timed
        clock = CpuClock(pids)
        started = time.perf_counter()
        count = 0
        for item in source:
            count += len(item.y) if hasattr(item, "y") else len(item[1])
            clock.tick()
        elapsed = time.perf_counter() - started
        cpu = clock.elapsed()
    finally:
        closer()
        split.close()
    return count / elapsed, count / cpu


def drop_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(files: list[Path]) -> float:
    """Bytes/s of the fastest plain read of every file start to end, the cache dropped first:
    8 MiB reads with the kernel told the access is sequential (its readahead doubles), or
    O_DIRECT 16 MiB reads on 4 threads; the better of the two is the file system's bound here."""
    drop_cache(files)
    buffer = bytearray(8 << 20)
    total, started = 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while read := os.readv(fd, [buffer]):
                total += read
        finally:
            os.close(fd)
    hinted = total / (time.perf_counter() - started)
    drop_cache(files)
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        total = sum(pool.map(_direct_read, [(path, offset) for path in files for offset in range(0, path.stat().st_size, DIRECT_BLOCK)]))
    return max(hinted, total / (time.perf_counter() - started))


DIRECT_BLOCK = 16 << 20
_direct_buffers = threading.local()


def _direct_read(task: tuple[Path, int]) -> int:
    path, offset = task
    if not hasattr(_direct_buffers, "buffer"):
        _direct_buffers.buffer = mmap.mmap(-1, DIRECT_BLOCK)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return os.preadv(fd, [_direct_buffers.buffer], offset)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=12000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--prefetch", type=int, default=2, help="batches read ahead (data.prefetch; DataLoader: prefetch_factor)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm-batches", type=int, default=40)
    parser.add_argument("--cold-batches", type=int, default=16)
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "hpctk-loader-bench")
    parser.add_argument("--loaders", default="ours,ours-thread,dataloader,dataloader-per-image")
    args = parser.parse_args()
    data_module.IN_MEMORY_LIMIT_BYTES = 0  # a real data set does not fit: read from the files
    torch.set_num_threads(1)
    files = make_shards(args.dir, args.images)
    images = sum(h5py.File(f, "r")["train/y"].shape[0] for f in files)
    sampler = ShardSampler(images, args.batch, 0, 1, seed=0)
    loaders = args.loaders.split(",")
    print(f"{images} images {SHAPE} uint8, {len(files)} shards, batch {args.batch}, {args.workers} worker(s), prefetch {args.prefetch}, {os.cpu_count()} cores")

    for path in files:  # into the page cache
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    warm: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
    for round_number in range(args.rounds):
        batches = list(sampler.batches(round_number))[: args.warm_batches + 1]
        for name in loaders[round_number % len(loaders) :] + loaders[: round_number % len(loaders)]:
            warm[name].append(run_loader(name, files, batches, args.workers, args.batch, args.prefetch))
    row_bytes = int(np.prod(SHAPE))
    raw: list[float] = []
    cold: dict[str, list[float]] = {name: [] for name in loaders}
    for round_number in range(args.rounds):
        raw.append(sequential_read(files) / row_bytes)
        batches = list(sampler.batches(100 + round_number))[: args.cold_batches + 1]
        for name in loaders:
            drop_cache(files)
            cold[name].append(run_loader(name, files, batches, args.workers, args.batch, args.prefetch)[0])

    print("\n| loader | page cache, images/s | images per CPU second | ours / this | cache dropped, images/s | of raw read | ours / this |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in loaders:
        rate = statistics.median(r for r, _ in warm[name])
        per_cpu = statistics.median(c for _, c in warm[name])
        ratio = statistics.median(o[0] / t[0] for o, t in zip(warm["ours"], warm[name], strict=True)) if "ours" in warm else float("nan")
        cold_rate = statistics.median(cold[name])
        fraction = statistics.median(c / r for c, r in zip(cold[name], raw, strict=True))
        cold_ratio = statistics.median(o / t for o, t in zip(cold["ours"], cold[name], strict=True)) if "ours" in cold else float("nan")
        print(f"| {name} | {rate:,.0f} | {per_cpu:,.0f} | {ratio:.2f}x | {cold_rate:,.0f} | {fraction:.2f} | {cold_ratio:.2f}x |")
    print(f"\nraw sequential read, cache dropped: {statistics.median(raw) * row_bytes / 1e9:.2f} GB/s = {statistics.median(raw):,.0f} images/s")


if __name__ == "__main__":
    main()
