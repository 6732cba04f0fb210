"""Batches read on worker processes and delivered in the sampler's exact order.

h5py holds a global lock, so threads cannot read HDF5 in parallel; processes can. Batch k of a
pass goes to worker k % workers and the rank receives batch k before batch k+1 whatever order
the workers finish in, so a resumed run reads exactly what the interrupted one would have.

- A data set that can fill a caller's buffer (`sample_layout()` and `read_into(indices, out)`,
  as trainers.data.H5Split does) is read straight into shared-memory slots made once and
  reused: no pickling, no new shared memory per batch, no copy on the way to the rank. A batch
  handed out stays valid while the next `HELD - 1` batches are used, then its slot is reused.
- Any other map-style data set (a user task's) is read with `read_items` in the worker and its
  items come back pickled, tensors through shared memory, as with torch's DataLoader.

Workers are forked once per run and serve every pass (`epoch()`). They ignore the stop signals
(the rank decides when to stop), die with the rank (PR_SET_PDEATHSIG), never run the rank's
exit handlers (no MPI_Finalize from a copy of the rank), and a worker that dies is reported as
one line instead of a hang.
"""

from __future__ import annotations

import collections
import ctypes
import multiprocessing.connection
import os
import signal
import time
import traceback
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.multiprocessing

from trainers.data import Prefetcher, RawBatch
from trainers.task import MapDataset, read_items

HELD = 2  # batches the rank may still hold (the one in use and the one before)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1


class DataWorkerError(RuntimeError):
    """A loader worker failed (the message names the worker, the batch and the cause)."""


class WorkerLoader:
    def __init__(self, dataset: MapDataset, workers: int, batch_size: int, prefetch: int = 2) -> None:
        if workers < 1:
            raise ValueError(f"a worker loader needs workers >= 1, not {workers}")
        self.dataset, self.workers = dataset, workers
        self.in_flight = max(prefetch, 2 * workers)  # each worker reads one batch and holds the next
        direct = callable(getattr(dataset, "read_into", None)) and callable(getattr(dataset, "sample_layout", None))
        self._slots: torch.Tensor | None = None
        if direct:
            shape, dtype = dataset.sample_layout()  # type: ignore[attr-defined]
            self._slots = torch.from_numpy(np.empty((self.in_flight + HELD, batch_size, *shape), dtype)).share_memory_()
        context = torch.multiprocessing.get_context("fork")
        self._connections: list[multiprocessing.connection.Connection] = []
        self._processes = []
        parent = os.getpid()
        for worker in range(workers):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(dataset, theirs, self._slots, worker, parent), name=f"data-worker-{worker}", daemon=True)
            # Held (not lost) in the rank while it forks; the worker starts with them blocked and ignores them.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()
            self._connections.append(ours)
            self._processes.append(process)
        self._pass = 0

    def epoch(self, batches: Iterable[np.ndarray], pin: Callable[[Any], Any] | None = None) -> Pass:
        """One pass over `batches` (sample indices per step); `pin` makes page-locked copies on a
        thread, for a GPU."""
        self._pass += 1
        return Pass(self, iter(batches), self._pass, pin)

    def _send(self, worker: int, message: tuple[int, int, np.ndarray, int | None]) -> None:
        try:
            self._connections[worker].send(message)
        except OSError:
            raise self._died(worker) from None

    def _wait(self) -> list[int]:
        """The workers with a result ready; a dead worker raises."""
        sentinels = {p.sentinel: i for i, p in enumerate(self._processes)}
        ready = multiprocessing.connection.wait([*self._connections, *sentinels])
        for item in ready:
            if item in sentinels and not self._connections[sentinels[item]].poll():
                raise self._died(sentinels[item])
        return [i for i, c in enumerate(self._connections) if c in ready or c.poll()]

    def _died(self, worker: int) -> DataWorkerError:
        process = self._processes[worker]
        process.join(timeout=1.0)
        reason = _exit_reason(process.exitcode)
        return DataWorkerError(f"data worker {worker} died ({reason}); lower data.workers or the batch size if memory is short")

    def close(self) -> None:
        for connection in self._connections:
            try:
                connection.send(None)
            except OSError:
                pass  # that worker is gone already
        deadline = time.monotonic() + 5.0
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self._connections:
            connection.close()
        self._connections, self._processes = [], []


class Pass:
    """The batches of one pass, in order; `wait_s` adds up the time the rank waited for them."""

    def __init__(self, loader: WorkerLoader, batches: Iterator[np.ndarray], number: int, pin: Callable[[Any], Any] | None) -> None:
        self._loader, self._batches, self._number = loader, batches, number
        self._free = collections.deque(range(loader.in_flight + HELD)) if loader._slots is not None else None
        self._held: collections.deque[int] = collections.deque()  # slots of delivered batches, oldest first
        self._ready: dict[int, tuple[Any, int | None]] = {}  # received out of order: batch -> (items, slot)
        self._sent = self._delivered = 0
        self._exhausted = False
        self._own_wait_s = 0.0
        self._items = self._ordered()
        self._pinned = Prefetcher(lambda batch: batch, self._items, depth=1, pin=pin) if pin is not None else None

    @property
    def wait_s(self) -> float:
        return self._pinned.wait_s if self._pinned is not None else self._own_wait_s

    def __iter__(self) -> Iterator[Any]:
        return iter(self._pinned) if self._pinned is not None else self._items

    def _ordered(self) -> Generator[Any, None, None]:
        loader = self._loader
        while True:
            self._submit()
            if self._delivered == self._sent:
                return
            started = time.perf_counter()
            while self._delivered not in self._ready:
                for worker in loader._wait():
                    self._receive(worker)
            self._own_wait_s += time.perf_counter() - started
            result, slot = self._ready.pop(self._delivered)
            self._delivered += 1
            if slot is not None:
                self._held.append(slot)
            yield result

    def _submit(self) -> None:
        loader = self._loader
        while not self._exhausted and self._sent - self._delivered < loader.in_flight:
            if self._free is not None:
                while len(self._held) >= HELD:  # the rank asks for batch k: batch k-2's slot is free
                    self._free.append(self._held.popleft())
            indices = next(self._batches, None)
            if indices is None:
                self._exhausted = True
                return
            slot = self._free.popleft() if self._free is not None else None
            loader._send(self._sent % loader.workers, (self._number, self._sent, np.asarray(indices, dtype=np.int64), slot))
            self._sent += 1

    def _receive(self, worker: int) -> None:
        number, k, slot, payload = self._loader._connections[worker].recv()
        if isinstance(payload, _Failure):
            raise DataWorkerError(f"data worker {worker}, batch {k}: {payload.text}")
        if number != self._number:  # a batch of a pass that was closed early
            if slot is not None and self._free is not None:
                self._free.append(slot)
            return
        if slot is not None:
            slots, (labels, scale) = self._loader._slots, payload
            assert slots is not None
            payload = RawBatch(slots[slot, : len(labels)], torch.from_numpy(labels), scale)
        self._ready[k] = (payload, slot)

    def close(self) -> None:
        """Stop early (a stop signal, the end of a run): the batches still being read are
        collected, so the next pass starts with every worker idle."""
        if self._pinned is not None:
            self._pinned.close()
        self._items.close()
        self._exhausted = True
        try:
            while len(self._ready) + self._delivered < self._sent:
                for worker in self._loader._wait():
                    self._receive(worker)
        except DataWorkerError:
            pass  # the run is ending on another error already, or the next pass reports it
        self._ready.clear()


class _Failure:
    """An exception in a worker, as text (the exception itself may not pickle)."""

    def __init__(self, text: str) -> None:
        self.text = text


def _serve(dataset: Any, connection: multiprocessing.connection.Connection, slots: torch.Tensor | None, worker: int, parent: int) -> None:
    """A worker's life: read the batches it is sent, in order, until told to stop."""
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the closed pipe still ends the worker
    if os.getppid() != parent:
        return  # the rank died before the worker was ready
    torch.set_num_threads(1)
    held: collections.deque[tuple[int, int, np.ndarray, int | None]] = collections.deque()
    will_need = getattr(dataset, "will_need", None)
    while True:
        try:
            while not held or connection.poll():  # take everything sent, and start its reads
                message = connection.recv()
                if message is None:
                    return
                held.append(message)
                if will_need is not None:
                    will_need(message[2])
        except (EOFError, OSError):
            return  # the rank is gone
        number, k, indices, slot = held.popleft()
        try:
            if slot is not None:
                assert slots is not None
                labels = dataset.read_into(indices, slots[slot].numpy())
                payload: Any = (labels, getattr(dataset, "scale", 1.0))
            else:
                payload = read_items(dataset, indices)
        except BaseException as err:
            last = traceback.extract_tb(err.__traceback__)[-1]
            payload = _Failure(f"{type(err).__name__}: {err} ({os.path.basename(last.filename)}:{last.lineno})")
        try:
            connection.send((number, k, slot, payload))
        except (EOFError, OSError):
            return


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (", often the out-of-memory killer" if -code == signal.SIGKILL else "")
    return f"exit code {code}"
