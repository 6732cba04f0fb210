"""Reading batches from HDF5 data sets (one file or many shards): raw (uint8 stays uint8), read
ahead on a thread or on worker processes (trainers.data.loader), decoded to float on the training
device, so a GPU gets a quarter of the bytes and never waits for the file.

Rows of a contiguous, uncompressed dataset (what trainers.data.convert writes) are read with
`os.preadv` straight into the batch's buffer: no HDF5 call, no global lock, one copy. Chunked or
compressed datasets are read through h5py."""

from __future__ import annotations

import os
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


@dataclass(frozen=True)
class _Shard:
    path: Path
    rows: int
    offset: int | None  # the inputs' byte offset in the file, when they can be read directly


class H5Split:
    """One split (inputs x, labels y) of an HDF5 file or of shards read as one (rows in shard
    order), a map-style data set whose `__getitems__(indices)` reads a whole batch at once and
    whose `read_into(indices, out)` fills a buffer the caller owns (the worker processes' shared
    slots). Files are opened per process, so a forked worker never shares a handle."""

    draws_random = False  # reading draws no random numbers: read ahead on a thread (trainers/rngstreams.py)

    def __init__(self, files: Path | Sequence[Path], x_name: str, y_name: str) -> None:
        self.x_name, self.y_name = x_name, y_name
        shards: list[_Shard] = []
        labels: list[np.ndarray] = []
        for path in [files] if isinstance(files, Path) else [Path(f) for f in files]:
            with h5py.File(path, "r") as f:
                if x_name not in f:
                    continue  # a shard of the other split
                x = f[x_name]
                if not shards:
                    # in this machine's byte order: h5py converts on reading, the direct path takes native rows only
                    self.sample_shape, self.dtype = tuple(x.shape[1:]), np.dtype(x.dtype).newbyteorder("=")
                    self.scale = float(x.attrs.get("scale", 1.0 / 255.0 if x.dtype == np.uint8 else 1.0))
                direct = x.chunks is None and x.compression is None and np.dtype(x.dtype).isnative
                shards.append(_Shard(path, int(x.shape[0]), x.id.get_offset() if direct else None))
                labels.append(f[y_name][:].astype(np.int64))
        if not shards:
            raise FileNotFoundError(f"no file holds {x_name}")
        self._shards = shards
        self._starts = np.cumsum([0] + [s.rows for s in shards])
        self._labels = np.concatenate(labels)
        self.row_bytes = int(np.prod(self.sample_shape)) * self.dtype.itemsize
        self._opened: dict[int, dict[int, Any]] = {}  # pid -> shard -> fd or h5py dataset, opened on first use
        self._in_memory = None
        if self.row_bytes * len(self) <= IN_MEMORY_LIMIT_BYTES:
            whole = np.empty((len(self), *self.sample_shape), self.dtype)
            for shard, (start, end) in enumerate(zip(self._starts[:-1], self._starts[1:], strict=True)):
                self._read_shard(shard, whole[start:end])
            self.close()
            self._in_memory = whole

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> RawBatch:
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[int] | np.ndarray) -> RawBatch:
        rows = np.asarray(indices, dtype=np.int64)
        x = np.empty((len(rows), *self.sample_shape), self.dtype)
        return RawBatch(torch.from_numpy(x), torch.from_numpy(self.read_into(rows, x)), self.scale)

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch decoded to float32 on the CPU."""
        batch = self.__getitems__(indices)
        return self.decode(batch.x), batch.y

    def decode(self, x: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """Stored values -> float32 inputs, on `device` (the copy moves the compact stored type)."""
        if device is not None:
            x = x.to(device, non_blocking=True)
        return x.to(torch.float32).mul_(self.scale)

    def sample_layout(self) -> tuple[tuple[int, ...], np.dtype]:
        """One sample's shape and type: what `read_into` writes per index."""
        return self.sample_shape, self.dtype

    def read_into(self, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Rows `indices` into out[:len(indices)] (in the order given); returns their labels."""
        indices = np.asarray(indices, dtype=np.int64)
        outside = indices[(indices < 0) | (indices >= len(self))]
        if len(outside):
            raise IndexError(f"sample index {outside[0]} is outside 0..{len(self) - 1}")
        if self._in_memory is not None:
            np.take(self._in_memory, indices, axis=0, out=out[: len(indices)])
            return self._labels[indices]
        shard_of, rows = self._locate(indices)
        for shard in np.unique(shard_of):
            at = np.flatnonzero(shard_of == shard)
            local = rows[at]
            order = np.argsort(local)  # ascending offsets: the disk and readahead see a forward scan
            at, local = at[order], local[order]
            offset, handle = self._shards[shard].offset, self._handle(shard)
            if offset is None:  # chunked or compressed: h5py reads increasing indices only
                out[at] = handle[local]
                continue
            for j, row in zip(at.tolist(), local.tolist(), strict=True):
                if os.preadv(handle, [out[j]], offset + row * self.row_bytes) != self.row_bytes:
                    raise OSError(f"{self._shards[shard].path}: row {row} of {self.x_name} is cut short (the file was truncated?)")
        return self._labels[indices]

    def will_need(self, indices: np.ndarray) -> None:
        """Ask the kernel to start reading these rows now (a worker calls it for the batches it
        holds next, so a cold cache reads with many requests in flight)."""
        if self._in_memory is not None:
            return
        shard_of, rows = self._locate(np.asarray(indices, dtype=np.int64))
        for shard, row in zip(shard_of.tolist(), rows.tolist(), strict=True):
            offset = self._shards[shard].offset
            if offset is not None:
                os.posix_fadvise(self._handle(shard), offset + row * self.row_bytes, self.row_bytes, os.POSIX_FADV_WILLNEED)

    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each index's shard, and its row within that shard."""
        shard_of = np.searchsorted(self._starts, indices, side="right") - 1
        return shard_of, indices - self._starts[shard_of]

    def _handle(self, shard: int) -> Any:
        """This process's handle on a shard (a forked worker opens its own), opened on first use:
        a process holds only the shards it has read."""
        opened = self._opened.setdefault(os.getpid(), {})
        if shard not in opened:
            info = self._shards[shard]
            if info.offset is not None:
                opened[shard] = os.open(info.path, os.O_RDONLY | os.O_CLOEXEC)
            else:
                opened[shard] = h5py.File(info.path, "r")[self.x_name]
        return opened[shard]

    def _read_shard(self, shard: int, out: np.ndarray) -> None:
        """A whole shard's inputs, in one read."""
        offset, handle = self._shards[shard].offset, self._handle(shard)
        if offset is None:
            out[:] = handle[:]
            return
        view, done = memoryview(out).cast("B"), 0  # type: ignore[arg-type]  # numpy arrays are buffers
        while done < len(view):  # one read returns at most ~2 GiB
            read = os.preadv(handle, [view[done:]], offset + done)
            if read == 0:
                raise OSError(f"{self._shards[shard].path}: {self.x_name} is cut short (the file was truncated?)")
            done += read

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_opened": {}}  # handles stay with the process that opened them

    def close(self) -> None:
        for handle in self._opened.pop(os.getpid(), {}).values():
            if isinstance(handle, int):
                os.close(handle)
            else:
                handle.file.close()


class Prefetcher:
    """Reads the next `depth` batches on a background thread (h5py and the copies release the
    GIL), made page-locked by `pin` when feeding a GPU. Iterating yields what `read(indices)`
    returns; `wait_s` adds up the time the training thread waited for data. `close()` stops the
    thread early (a stop signal, the end of a run); batches are always delivered in the
    sampler's order."""

    def __init__(self, read: Callable[[np.ndarray], Any], batches: Iterable[np.ndarray], depth: int = 2, pin: Callable[[Any], Any] | None = None) -> None:
        self._read, self._pin = read, pin
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self.wait_s = 0.0
        self._batches = iter(batches)
        self._thread: threading.Thread | None = None
        if depth > 0:  # depth 0: every batch read on the thread that iterates, when it asks (no read-ahead)
            self._thread = threading.Thread(target=self._produce, args=(self._batches,), name="h5-prefetch", daemon=True)
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
        if self._thread is None:
            yield from self._read_here()
            return
        while True:
            started = time.perf_counter()
            item = self._queue.get()
            self.wait_s += time.perf_counter() - started
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item.batch

    def _read_here(self) -> Iterator[Any]:
        for indices in self._batches:
            if self._stop.is_set():
                return
            started = time.perf_counter()
            batch = self._read(indices)
            batch = self._pin(batch) if self._pin is not None else batch
            self.wait_s += time.perf_counter() - started
            yield batch

    def close(self) -> None:
        self._stop.set()
        while self._thread is not None and self._thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.1)


@dataclass(frozen=True)
class _Item:
    """A batch in the queue (whatever its type, it cannot be mistaken for the end or an error)."""

    batch: Any
