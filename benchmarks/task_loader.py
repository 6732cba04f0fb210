"""A task's own map-style data set through the loader, against torch's DataLoader on the same
data set and the same batches (issue 45: with data.workers=2 it read about 10x slower than
with workers=0, each sample's tensors sent back one by one).

    python -m benchmarks.task_loader [--samples 40000] [--batch 256] [--workers 2] [--rounds 3]

The data set is what a user writes for CIFAR-sized images: an in-memory uint8 array, each item
converted to float, scaled and flipped at random in `__getitem__`, with an integer label.
Loaders, in interleaved rounds, each over the same batches (the sampler's order for one rank):
- ours: `data.workers=W`, items collated in the worker (torch's default collate), as now;
- ours, items sent: the same workers sending every sample back unbatched (before the fix);
- ours, workers=0: read and collated on the rank's thread;
- DataLoader: torch's DataLoader, W workers, batch_sampler, default collate.
Samples/s from the first batch received to the last (worker start-up excluded); the ratio to
DataLoader is the median over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainers.data.loader import WorkerLoader  # noqa: E402
from trainers.data.sampler import ShardSampler  # noqa: E402
from trainers.task import read_items  # noqa: E402

LOADERS = ("ours", "ours, items sent", "ours, workers=0", "DataLoader")


class SmallImages(torch.utils.data.Dataset):
    """32 x 32 RGB images in memory; an item is a float image, flipped at random, and its label."""

    def __init__(self, samples: int) -> None:
        rng = np.random.default_rng(0)
        self.x = torch.from_numpy(rng.integers(0, 256, (samples, 3, 32, 32), dtype=np.uint8))
        self.y = torch.from_numpy(rng.integers(0, 10, samples))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.x[index].float().div_(255)
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, self.y[index]


def rate(name: str, dataset: SmallImages, batches: list[np.ndarray], workers: int, prefetch: int) -> float:
    """Samples/s over `batches` after the first (start-up excluded)."""
    closer: Any = lambda: None  # noqa: E731
    if name.startswith("ours") and name != "ours, workers=0":
        loader = WorkerLoader(dataset, workers, len(batches[0]), prefetch, streams=(0, 0), collate=default_collate if name == "ours" else None)
        source: Iterator[Any] = iter(loader.epoch(iter(batches)))
        closer = loader.close
    elif name == "ours, workers=0":
        source = (default_collate(read_items(dataset, rows)) for rows in batches)
    else:
        it = iter(DataLoader(dataset, batch_sampler=[b.tolist() for b in batches], num_workers=workers, prefetch_factor=prefetch))
        source, closer = it, it._shutdown_workers  # type: ignore[attr-defined]
    try:
        next(source)
        count, started = 0, time.perf_counter()
        for batch in source:
            images = batch.value[0] if hasattr(batch, "value") else batch[0] if isinstance(batch, list | tuple) and isinstance(batch[0], torch.Tensor) else None
            count += len(images) if images is not None else len(batch)
        return count / (time.perf_counter() - started)
    finally:
        closer()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.task_loader", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=40000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = SmallImages(args.samples)
    sampler = ShardSampler(len(dataset), args.batch, 0, 1, seed=0)
    rates: dict[str, list[float]] = {name: [] for name in LOADERS}
    for round_number in range(args.rounds):
        batches = list(sampler.batches(round_number + 1))
        order = LOADERS if round_number % 2 == 0 else LOADERS[::-1]  # interleaved: neither side always first
        for name in order:
            rates[name].append(rate(name, dataset, batches, args.workers, args.prefetch))
        print(f"round {round_number + 1}: " + ", ".join(f"{name} {rates[name][-1]:.0f}" for name in LOADERS), flush=True)
    reference = rates["DataLoader"]
    print(f"\n{len(dataset)} samples 3x32x32, batch {args.batch}, {args.workers} workers, prefetch {args.prefetch}, {args.rounds} rounds")
    print("| loader | samples/s, median | vs DataLoader, median of rounds |")
    print("| --- | --- | --- |")
    for name in LOADERS:
        ratios = [ours / theirs for ours, theirs in zip(rates[name], reference, strict=True)]
        print(f"| {name} | {statistics.median(rates[name]):.0f} | {statistics.median(ratios):.2f}x |")


if __name__ == "__main__":
    main()
