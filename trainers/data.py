"""Reading batches from an HDF5 data set: raw (uint8 stays uint8) on a prefetch thread, decoded
to float on the training device, so a GPU gets a quarter of the bytes and never waits for the file."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

IN_MEMORY_LIMIT_BYTES = 1 << 30  # smaller splits are read once and kept in memory


@dataclass(frozen=True)
class RawBatch:
    """A batch as stored (uint8 images stay uint8), its int64 labels, and the factor that turns
    the stored values into float inputs."""

    x: torch.Tensor
    y: torch.Tensor
    scale: float

    def pin_memory(self) -> RawBatch:
        return RawBatch(self.x.pin_memory(), self.y.pin_memory(), self.scale)


class H5Split:
    """One split (inputs x, labels y) of an HDF5 file, a map-style data set whose
    `__getitems__(indices)` reads a whole batch at once; `read(indices)` decodes one."""

    def __init__(self, path: Path, x_name: str, y_name: str) -> None:
        self._file = h5py.File(path, "r")
        self._x = self._file[x_name]
        self._y = self._file[y_name]
        self.scale = float(self._x.attrs.get("scale", 1.0 / 255.0 if self._x.dtype == np.uint8 else 1.0))
        self._cached_x = self._x[:] if self._x.nbytes <= IN_MEMORY_LIMIT_BYTES else None
        self._cached_y = self._y[:]

    def __len__(self) -> int:
        return int(self._y.shape[0])

    def __getitem__(self, index: int) -> RawBatch:
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[int]) -> RawBatch:
        x, y = self.read_raw(np.asarray(indices, dtype=np.int64))
        return RawBatch(x, y, self.scale)

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch decoded to float32 on the CPU."""
        x, y = self.read_raw(indices)
        return self.decode(x), y

    def decode(self, x: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """Stored values -> float32 inputs, on `device` (the copy moves the compact stored type)."""
        if device is not None:
            x = x.to(device, non_blocking=True)
        return x.to(torch.float32).mul_(self.scale)

    def read_raw(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch as stored (uint8 images stay uint8) and its int64 labels, on the CPU."""
        if self._cached_x is not None:
            x = self._cached_x[indices]
        else:
            # h5py reads fancy indices only in increasing order: sort, read, restore the order.
            order = np.argsort(indices)
            x = np.empty((len(indices), *self._x.shape[1:]), dtype=self._x.dtype)
            x[order] = self._x[indices[order]]
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(self._cached_y[indices].astype(np.int64))

    def close(self) -> None:
        self._file.close()


class Prefetcher:
    """Reads the next `depth` batches on a background thread (h5py and the copies release the
    GIL), made page-locked by `pin` when feeding a GPU. Iterating yields what `read(indices)`
    returns; `wait_s` adds up the time the training thread waited for data. `close()` stops the
    thread early (a stop signal, the end of a run); batches are always delivered in the
    sampler's order."""

    def __init__(self, read: Callable[[np.ndarray], Any], batches: Iterable[np.ndarray], depth: int = 2, pin: Callable[[Any], Any] | None = None) -> None:
        self._read, self._pin = read, pin
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._produce, args=(iter(batches),), name="h5-prefetch", daemon=True)
        self._thread.start()

    def _produce(self, batches: Iterator[np.ndarray]) -> None:
        try:
            for indices in batches:
                batch = self._read(indices)
                if self._pin is not None:
                    batch = self._pin(batch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(_Item(batch), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(None)
        except BaseException as err:  # delivered to the training thread, which raises it
            self._queue.put(err)

    def __iter__(self) -> Iterator[Any]:
        while True:
            started = time.perf_counter()
            item = self._queue.get()
            self.wait_s += time.perf_counter() - started
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item.batch

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.1)


@dataclass(frozen=True)
class _Item:
    """A batch in the queue (whatever its type, it cannot be mistaken for the end or an error)."""

    batch: Any
