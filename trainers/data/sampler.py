"""Which samples each rank reads, as a pure function of (seed, epoch, position, rank).

Every epoch has one global permutation from (seed, epoch). A step consumes the next
`global_batch` positions of it, and rank r takes the contiguous slice r of that window. The
data position is therefore a *global* sample index: a run can restart at (epoch, position)
with a different world size and read exactly the samples the interrupted run had not read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardSampler:
    num_samples: int
    batch_size: int  # per rank
    rank: int
    world_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.num_samples < self.global_batch:
            raise ValueError(
                f"{self.num_samples} training samples cannot fill one global batch of "
                f"{self.global_batch} ({self.world_size} ranks x {self.batch_size}); lower data.batch_size"
            )

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        # The last incomplete global batch is dropped; the next epoch's permutation differs.
        return self.num_samples // self.global_batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def batches(self, epoch: int, start: int = 0) -> Iterator[np.ndarray]:
        """This rank's sample indices for each remaining step of `epoch`, from global position `start`."""
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start position {start} outside epoch of {self.num_samples} samples")
        order = self.epoch_order(epoch)
        usable = self.steps_per_epoch * self.global_batch
        for window in range(start, usable - self.global_batch + 1, self.global_batch):
            lo = window + self.rank * self.batch_size
            yield order[lo : lo + self.batch_size]


def eval_shard(num_samples: int, rank: int, world_size: int) -> np.ndarray:
    """Disjoint strided shards covering every evaluation sample exactly once."""
    return np.arange(rank, num_samples, world_size)
