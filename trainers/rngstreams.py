"""The random streams of a run, independent per rank and per batch of data, and reproducible.

- Every rank's own stream (torch CPU and CUDA, numpy's global, Python's `random`), seeded from
  (trainer.seed, rank) once the model and the data sets are built (those are drawn from
  trainer.seed alike on every rank; the model's weights are rank 0's anyway, by broadcast). It
  draws dropout masks, crop offsets and flips; checkpoints keep it per rank.
- A task's data set reading a batch (`__getitem__` on a loader process, or on the training thread
  with data.workers=0) does so inside a stream of its own, seeded from (trainer.seed, rank, the
  epoch, the batch's sample indices): whichever process reads it, and however often the run was stopped and
  resumed, a batch's random transforms are the same, and they never consume the rank's stream.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator

import numpy as np
import torch


def stream_seed(*key: int | bytes) -> int:
    """A 63-bit seed from `key`, decorrelated from neighbouring keys (a hash, not a sum)."""
    digest = hashlib.blake2b(b"\0".join(k if isinstance(k, bytes) else str(k).encode() for k in key), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_all(seed: int) -> None:
    """torch (CPU and every CUDA device), numpy's global generator and Python's `random`."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def seed_rank(seed: int, rank: int) -> None:
    seed_all(stream_seed(seed, rank))


def batch_seed(seed: int, rank: int, epoch: int, indices: np.ndarray) -> int:
    """A batch's own stream: the same batch of the same epoch draws the same, on any worker and
    after any restart; the same samples in another epoch draw anew."""
    return stream_seed(seed, rank, epoch, np.ascontiguousarray(indices, dtype=np.int64).tobytes())


def reseed(seed: int) -> None:
    """This process's streams (torch CPU, numpy, random) restarted at `seed`, the old ones not
    kept: for a loader worker, whose streams serve one batch at a time (isolated() keeps and
    restores them, 240 us a batch here, 2% of a 256-sample batch at 20k samples/s)."""
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: it would reseed CUDA's too
    np.random.seed(seed % 2**32)
    random.seed(seed)


@contextlib.contextmanager
def isolated(seed: int) -> Iterator[None]:
    """Draws inside come from a stream seeded with `seed`; the caller's streams (torch CPU, numpy,
    random) are as they were afterwards. CUDA's are left alone: reading data draws on the CPU."""
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # not torch.manual_seed: it would reseed CUDA's too
        np.random.seed(seed % 2**32)
        random.seed(seed)
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)
