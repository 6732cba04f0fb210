"""Batches read on worker processes and delivered in the sampler's exact order.

h5py holds a global lock, so threads cannot read HDF5 in parallel; processes can. Batch k of a
pass goes to worker k % workers and the rank receives batch k before batch k+1 whatever order
the workers finish in, so a resumed run reads exactly what the interrupted one would have.

- A data set that can fill a caller's buffer (`sample_layout()` and `read_into(indices, out)`,
  as trainers.data.reading.H5Split does) is read straight into shared-memory slots made once and
  reused: no pickling, no new shared memory per batch, no copy on the way to the rank. A batch
  handed out stays valid while the next `HELD - 1` batches are used, then its slot is reused.
- The indices of a batch travel in shared memory too, so what goes down a pipe is a few bytes
  each way and neither side can block the other, whatever the batch size.
- Any other map-style data set (a user task's) is read with `read_items` in the worker, collated
  there (torch's default collate, unless the task collates in its own `batch`) and sent back
  pickled, tensors through shared memory, as torch's DataLoader does: one tensor per field.

Workers are forked once per run and serve every pass (`epoch()`). They ignore the stop signals
(the rank decides when to stop), die with the rank (PR_SET_PDEATHSIG), never run the rank's
exit handlers (no MPI_Finalize from a copy of the rank), and a worker that dies is reported as
one line instead of a hang.

Once a pass has asked for all its batches, the next epoch's first ones are asked for (where the
caller names them): they are read while the pass's last steps, the epoch's evaluation and its
save run, and the next pass, if it starts where they do, begins with them ready instead of
waiting for a whole batch to be read (on a GPU, 1.6% of a 30-step ResNet-50 epoch).
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
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
import torch.multiprocessing

from trainers import rngstreams
from trainers.data.reading import Prefetcher, RawBatch
from trainers.task import Collated, MapDataset, read_items

HELD = 2  # batches the rank may still hold (the one in use and the one before)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1


class DataWorkerError(RuntimeError):
    """A loader worker failed (the message names the worker, the batch and the cause)."""


@dataclass(frozen=True)
class _Shared:
    """Shared memory, one row per slot: the batch's indices, and for a data set read in place
    its inputs and labels."""

    indices: torch.Tensor  # slots x batch_size int64
    inputs: torch.Tensor | None  # slots x batch_size x sample shape
    labels: torch.Tensor | None  # slots x batch_size int64


class WorkerLoader:
    def __init__(
        self,
        dataset: MapDataset,
        workers: int,
        batch_size: int,
        prefetch: int = 2,
        streams: tuple[int, int] | None = None,
        collate: Callable[[Any], Any] | None = None,
    ) -> None:
        """`streams`: (seed, rank) to read a task's items in each batch's own random stream
        (trainers/rngstreams.py); None: as the process's streams stand after the fork.
        `collate`: applied to a task's items in the worker (they come back `Collated`: a tensor
        per field, not one per sample, each of which costs a shared-memory handle to send)."""
        if workers < 1:
            raise ValueError(f"a worker loader needs workers >= 1, not {workers}")
        self.dataset, self.workers, self.batch_size, self.streams = dataset, workers, batch_size, streams
        self.in_flight = max(prefetch, 2 * workers)  # each worker reads one batch and holds the next
        slots = self.in_flight + HELD
        inputs = labels = None
        if callable(getattr(dataset, "read_into", None)) and callable(getattr(dataset, "sample_layout", None)):
            shape, dtype = dataset.sample_layout()  # type: ignore[attr-defined]
            inputs = torch.from_numpy(np.empty((slots, batch_size, *shape), dtype)).share_memory_()
            labels = torch.empty((slots, batch_size), dtype=torch.int64).share_memory_()
        self.shared = _Shared(torch.empty((slots, batch_size), dtype=torch.int64).share_memory_(), inputs, labels)
        self.free = collections.deque(range(slots))  # slots no batch occupies
        self.broken: str | None = None  # a worker died: no further pass
        self._current: Pass | None = None
        self.ahead: Pass | None = None  # the next epoch's batches, asked for before its pass starts
        self.live: dict[int, Pass] = {}  # passes whose batches may still come back, by number
        self._pass = 0
        context = torch.multiprocessing.get_context("fork")
        self._connections: list[multiprocessing.connection.Connection] = []
        self._processes = []
        parent = os.getpid()
        for worker in range(workers):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(dataset, theirs, self.shared, parent, collate), name=f"data-worker-{worker}", daemon=True)
            # Held (not lost) in the rank while it forks; the worker starts with them blocked and ignores them.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()
            self._connections.append(ours)
            self._processes.append(process)

    def epoch(
        self,
        batches: Iterable[np.ndarray],
        pin: Callable[[Any], Any] | None = None,
        epoch: int = 0,
        start: int = 0,
        following: Callable[[], Iterable[np.ndarray]] | None = None,
    ) -> Pass:
        """One pass over `batches` (sample indices per step) of training epoch `epoch` from data
        position `start`; `pin` makes page-locked copies on a thread, for a GPU. `following`:
        epoch + 1's batches from its start (a pure function of the epoch, as the sampler's are),
        asked for once this pass has asked for all of its own; a pass of epoch + 1 from start 0
        takes them over, any other pass drops them."""
        if self._current is not None:
            self._current.close()  # first: its reading thread may still start the read-ahead
        ahead, self.ahead = self.ahead, None
        if self.broken is not None:
            if ahead is not None:
                ahead.close()
            raise DataWorkerError(self.broken)
        if ahead is not None and ahead.epoch == epoch and start == 0:
            ahead.begin(pin, following)
            self._current = ahead
        else:
            if ahead is not None:
                ahead.close()
            self._current = Pass(self, iter(batches), self.next_number(), epoch)
            self._current.begin(pin, following)
        return self._current

    def next_number(self) -> int:
        self._pass += 1
        return self._pass

    def send(self, worker: int, message: tuple[int, int, int, int, int]) -> None:
        try:
            self._connections[worker].send(message)
        except OSError:
            raise self.died(worker) from None

    def receive(self, worker: int) -> tuple[int, int, int, int, Any]:
        try:
            return self._connections[worker].recv()
        except (EOFError, OSError):
            raise self.died(worker) from None

    def wait(self) -> list[int]:
        """The workers with a message ready (a dead worker's closed pipe is one: receive names it)."""
        sentinels = {p.sentinel: i for i, p in enumerate(self._processes)}
        ready = multiprocessing.connection.wait([*self._connections, *sentinels])
        dead = [sentinels[item] for item in ready if item in sentinels]
        return sorted({i for i, c in enumerate(self._connections) if c in ready} | set(dead))

    def collect(self, worker: int) -> None:
        """A worker's answer, to the pass that asked for it (a closed pass's slot goes back)."""
        number, k, slot, rows, payload = self.receive(worker)
        owner = self.live.get(number)
        if owner is None:
            self.free.append(slot)
            return
        if isinstance(payload, _Failure):
            payload.worker = worker
        owner.arrived(k, slot, rows, payload)

    def died(self, worker: int) -> DataWorkerError:
        process = self._processes[worker]
        process.join(timeout=1.0)
        self.broken = f"data worker {worker} died ({_exit_reason(process.exitcode)})"
        return DataWorkerError(self.broken)

    def close(self) -> None:
        for still in (self._current, self.ahead):
            if still is not None:
                still.close()
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
    """The batches of one pass, in order; `wait_s` adds up the time the rank waited for them.
    Asked for from its creation; delivered once `begin` is called."""

    def __init__(self, loader: WorkerLoader, batches: Iterator[np.ndarray], number: int, epoch: int = 0) -> None:
        self._loader, self._batches, self._number, self.epoch = loader, batches, number, epoch
        self._following: Callable[[], Iterable[np.ndarray]] | None = None  # set by begin()
        loader.live[number] = self
        self._held: collections.deque[int] = collections.deque()  # slots of delivered batches, oldest first
        self._ready: dict[int, tuple[int, int, Any]] = {}  # received out of order: batch -> (slot, rows, items)
        self._outstanding: set[int] = set()  # batches sent and not yet received
        self._sent = self._delivered = 0
        self._exhausted = self._closed = False
        self._own_wait_s = 0.0
        self._items = self._ordered()
        self._pinned: Prefetcher | None = None

    def begin(self, pin: Callable[[Any], Any] | None, following: Callable[[], Iterable[np.ndarray]] | None) -> None:
        """Deliver from now on (`pin`: on a thread of its own, page-locked); `following`: as epoch()'s."""
        self._following = following
        if pin is not None:
            self._pinned = Prefetcher(lambda batch: batch, self._items, depth=1, pin=pin)

    @property
    def wait_s(self) -> float:
        return self._pinned.wait_s if self._pinned is not None else self._own_wait_s

    def __iter__(self) -> Iterator[Any]:
        return iter(self._pinned) if self._pinned is not None else self._items

    def _ordered(self) -> Generator[Any, None, None]:
        loader = self._loader
        while True:
            self._release(keep=HELD - 1)  # the rank asks for batch k: batch k-2's slot is free
            self._submit()
            if self._exhausted:
                self._read_ahead()
            if self._delivered == self._sent:
                self._release(keep=1)  # the rank may still use the last batch
                return
            started = time.perf_counter()
            while self._delivered not in self._ready:
                for worker in loader.wait():
                    loader.collect(worker)
            self._own_wait_s += time.perf_counter() - started
            slot, rows, payload = self._ready.pop(self._delivered)
            self._delivered += 1
            self._held.append(slot)
            if isinstance(payload, _Failure):
                raise DataWorkerError(f"data worker {payload.worker}, batch {self._delivered - 1}: {payload.text}")
            shared = loader.shared
            if shared.inputs is not None and shared.labels is not None:
                payload = RawBatch(shared.inputs[slot, :rows], shared.labels[slot, :rows], payload)
            yield payload

    def _submit(self) -> None:
        loader, indices_of = self._loader, self._loader.shared.indices
        # A pass that reads ahead shares the slots with the pass before it; the pass being
        # delivered never falls short (in_flight + HELD slots, the pass before it closed).
        while not self._exhausted and self._sent - self._delivered < loader.in_flight and loader.free:
            indices = next(self._batches, None)
            if indices is None:
                self._exhausted = True
                return
            rows = len(indices)
            if rows > loader.batch_size:
                raise ValueError(f"a batch of {rows} samples does not fit the loader's {loader.batch_size}")
            slot = loader.free.popleft()
            indices_of[slot, :rows] = torch.from_numpy(np.asarray(indices, dtype=np.int64))
            streams = loader.streams
            seed = -1 if streams is None else rngstreams.batch_seed(*streams, self.epoch, indices)  # -1: the worker's own streams
            loader.send(self._sent % loader.workers, (self._number, self._sent, slot, rows, seed))
            self._outstanding.add(self._sent)
            self._sent += 1

    def _read_ahead(self) -> None:
        """This pass has asked for all its batches: the next epoch's first ones, in the slots
        this pass frees, while it delivers its last."""
        loader = self._loader
        if self._following is not None and loader.ahead is None:
            loader.ahead = Pass(loader, iter(self._following()), loader.next_number(), self.epoch + 1)
            self._following = None
        if loader.ahead is not None and loader.ahead is not self:
            loader.ahead._submit()

    def _release(self, keep: int) -> None:
        while len(self._held) > keep:
            self._loader.free.append(self._held.popleft())

    def arrived(self, k: int, slot: int, rows: int, payload: Any) -> None:
        self._outstanding.discard(k)
        self._ready[k] = (slot, rows, payload)

    def close(self) -> None:
        """Stop early (a stop signal, the end of a run): the batches still being read are
        collected, so the next pass starts with every worker idle and every slot free."""
        if self._closed:
            return
        self._closed = True
        if self._pinned is not None:
            self._pinned.close()
        self._items.close()
        self._exhausted = True
        try:
            while self._outstanding:
                for worker in self._loader.wait():
                    self._loader.collect(worker)
        except DataWorkerError:
            pass  # the loader is broken: its next pass raises
        self._loader.live.pop(self._number, None)
        for slot, _, _ in self._ready.values():
            self._loader.free.append(slot)
        self._ready.clear()
        self._release(keep=0)


class _Failure:
    """An exception in a worker, as one line of text (the exception itself may not pickle)."""

    def __init__(self, err: BaseException) -> None:
        frames = traceback.extract_tb(err.__traceback__)
        where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
        self.text = f"{type(err).__name__}: {' '.join(str(err).split())}{where}"
        self.worker = -1


def _serve(dataset: Any, connection: multiprocessing.connection.Connection, shared: _Shared, parent: int, collate: Callable[[Any], Any] | None = None) -> None:
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
    held: collections.deque[tuple[int, int, int, int, int]] = collections.deque()
    will_need = getattr(dataset, "will_need", None)
    while True:
        try:
            while not held or connection.poll():  # take everything sent, and start its reads
                message = connection.recv()
                if message is None:
                    return
                held.append(message)
                if will_need is not None:
                    _hint(will_need, shared.indices[message[2], : message[3]].numpy())
        except (EOFError, OSError):
            return  # the rank is gone
        number, k, slot, rows, seed = held.popleft()
        try:
            indices = shared.indices[slot, :rows].numpy().copy()
            if shared.inputs is not None and shared.labels is not None:
                shared.labels[slot, :rows] = torch.from_numpy(dataset.read_into(indices, shared.inputs[slot].numpy()))
                payload: Any = float(getattr(dataset, "scale", 1.0))
            else:
                if seed >= 0:
                    rngstreams.reseed(seed)  # the batch's own stream; the worker keeps none of its own
                payload = read_items(dataset, indices)
                if collate is not None:
                    payload = Collated(collate(payload))
            reply = ForkingPickler.dumps((number, k, slot, rows, payload))
        except BaseException as err:  # reading, or items that cannot be sent back
            reply = ForkingPickler.dumps((number, k, slot, rows, _Failure(err)))
        try:
            connection.send_bytes(reply)
        except (EOFError, OSError):
            return


def _hint(will_need: Callable[[np.ndarray], None], indices: np.ndarray) -> None:
    try:
        will_need(indices)
    except Exception:  # only a hint: the read itself reports what is wrong
        pass


def _exit_reason(code: int | None) -> str:
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL:
        return f"killed by {name}, often the out-of-memory killer; lower data.workers or the batch size if memory is short"
    return f"killed by {name}"
