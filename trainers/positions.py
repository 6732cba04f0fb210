"""Data positions a run handle keeps (hpc.run): each is an object with state_dict/load_state_dict,
so a requeued script reads exactly the data the interrupted one had not read yet.

- `ShuffledBatches`: map-style data through the toolkit's sampler (trainers.sampler): one global
  permutation per epoch, rank r reads slice r of each global batch. Its position is a global
  sample index, the same on every rank: register it as shared state (a resume on another world
  size still reads each sample once per epoch).
- `RandomWindows`: random-offset windows of a 1-D token array (a memory-mapped file), as
  nanoGPT's get_batch draws them, from a generator of the rank's own: register it per_rank().
- `StreamCursor`: an iterable or streaming data set that can be reopened at an item count; it
  counts what the loop took: register it per_rank().
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from trainers.sampler import ShardSampler


class ShuffledBatches:
    """This rank's index batches, epoch after epoch: `for indices in batches.epoch(): ...`."""

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int = 0) -> None:
        self.sampler = ShardSampler(num_samples, batch_size, rank, world_size, seed)
        self.epoch_number = 0  # epochs begun, 1-based while one runs
        self.position = 0  # global samples of the current epoch taken

    def epoch(self) -> Iterator[np.ndarray]:
        """The rest of the current epoch's batches (all of the next one's when it is done); the
        position moves when a batch is handed out, so a checkpoint after the step holds it."""
        if self.epoch_number == 0 or self.position >= self.sampler.steps_per_epoch * self.sampler.global_batch:
            self.epoch_number, self.position = self.epoch_number + 1, 0
        for indices in self.sampler.batches(self.epoch_number, start=self.position):
            self.position += self.sampler.global_batch
            yield indices

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch_number, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch_number, self.position = int(state["epoch"]), int(state["position"])


class RandomWindows:
    """`get()`: a batch of (inputs, targets) windows at random offsets of `tokens`, targets
    shifted by one, from this rank's own generator (its state is the data position). Both are
    contiguous int64 tensors, as nanoGPT's get_batch stacks them (its `targets.view(-1)`)."""

    def __init__(self, tokens: Any, block_size: int, batch_size: int, seed: int, rank: int) -> None:
        if len(tokens) <= block_size:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of {block_size} + 1")
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,), generator=self.generator).tolist()
        rows = np.stack([np.asarray(self.tokens[s : s + self.block_size + 1], dtype=np.int64) for s in starts])
        window = torch.from_numpy(rows)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # views of one array would have its stride

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


class StreamCursor:
    """Items of a stream, counted: `open_at(n)` must give the stream from its n-th item on (a
    reader that seeks, or one that skips n items); after a resume it is reopened at the count."""

    def __init__(self, open_at: Callable[[int], Iterable[Any]]) -> None:
        self.open_at, self.taken = open_at, 0
        self._items: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._items is None:
            self._items = iter(self.open_at(self.taken))
        item = next(self._items)
        self.taken += 1
        return item

    def state_dict(self) -> dict[str, int]:
        return {"taken": self.taken}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.taken, self._items = int(state["taken"]), None
