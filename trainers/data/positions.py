"""Data positions for the run handle (hpc.run), so that a requeued script reads exactly the data
the uninterrupted one would have read.

The rule for bit-exact resume: everything a step uses must come from registered state or be a
pure function of the step. A batch drawn ahead of its step (nanoGPT draws step k+1's batch
inside step k) lives in a local variable that no checkpoint holds: after a resume it is drawn
again from whatever the position then says. Positions that are pure functions of an index
(`RandomWindows.batch(i)`, `ShuffledBatches.at(step)`) give the same batch whenever they are
asked, ahead of time or not, and draw nothing from torch's global generator (dropout's).

- `ShuffledBatches`: map-style data through the toolkit's sampler (trainers.data.sampler): one global
  permutation per epoch, rank r reads slice r of each global batch. `at(step)` is the batch of a
  global step; `epoch()` hands out the rest of the current epoch, its position a global sample
  index, the same on every rank: register it as shared state (a resume on another world size
  still reads each sample once per epoch).
- `RandomWindows`: random-offset windows of a 1-D token array (a memory-mapped file), as
  nanoGPT's get_batch draws them: `batch(i)` from a generator seeded by (seed, rank, i) alone.
- `StreamCursor`: an iterable or streaming data set that can be reopened at an item count; it
  counts what the loop took: register it per_rank().
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from trainers.data.sampler import ShardSampler


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

    def at(self, step: int) -> np.ndarray:
        """This rank's indices for global step `step` (0-based, counted over epochs): a pure
        function of the step, so a loop may draw it ahead of the step (nothing to register)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        sampler = self.sampler
        epoch, within = divmod(step, sampler.steps_per_epoch)
        return next(sampler.batches(epoch + 1, start=within * sampler.global_batch))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch_number, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch_number, self.position = int(state["epoch"]), int(state["position"])


class RandomWindows:
    """Batches of (inputs, targets) windows at random offsets of `tokens`, targets shifted by one.
    Both are contiguous int64 tensors, as nanoGPT's get_batch stacks them (its `targets.view(-1)`).

    `batch(i)`: batch number i of this rank (the step, or step * accumulation + micro-step),
    drawn with a generator seeded by (seed, rank, i): the same windows whenever it is asked, so
    a loop may draw ahead, and a resume needs nothing saved. `get()`: the next batch in draw
    order (`batch(0)`, `batch(1)`, ...), its count kept when registered per_rank(); only for
    loops that draw each batch inside its own step (a batch drawn ahead is lost at a stop)."""

    def __init__(self, tokens: Any, block_size: int, batch_size: int, seed: int, rank: int) -> None:
        if len(tokens) <= block_size:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of {block_size} + 1")
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.rank = seed, rank
        self.drawn = 0  # batches get() handed out

    def starts(self, index: int) -> np.ndarray:
        """The window offsets of batch `index`."""
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        return np.random.default_rng([self.seed, self.rank, index]).integers(0, len(self.tokens) - self.block_size, size=self.batch_size)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([np.asarray(self.tokens[s : s + self.block_size + 1], dtype=np.int64) for s in self.starts(index).tolist()])
        window = torch.from_numpy(rows)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # views of one array would have its stride

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        index, self.drawn = self.drawn, self.drawn + 1
        return self.batch(index)

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "drawn" not in state:  # written before batches were numbered: a generator's state
            raise ValueError("this RandomWindows state is from an older toolkit (a generator's state, not a batch count); start a new run dir")
        self.drawn = int(state["drawn"])


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
