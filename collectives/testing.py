"""Ranks as threads of one process: a testing utility for code that takes a Collectives (the
toolkit's own tests, and a user's tests of their task or script on several ranks without MPI).

    from collectives.testing import ThreadWorld
    losses = ThreadWorld(2).run(lambda comm: my_training(comm))  # one result per rank

Not a backend: every collective is a blocking exchange between threads; the process-global
state (torch's RNG, its thread pool) stays shared (see ThreadWorld).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from collectives.base import Deferred, ReduceOp, reduce_scatter_by_allreduce

T = TypeVar("T")


class ThreadWorld:
    """N ranks as N threads of one process, for in-process tests of multi-rank code (fit()).

    Every collective is an exchange through shared slots between two barrier waits, reduced
    in rank order, so every rank gets the same bits. What is process-global stays shared: the
    torch RNG (fit() seeds it and initialises the model with it; rank 0's parameters win the
    broadcast, and `run` starts a rank only once the one before is inside its first
    collective, so no two initialisations interleave), torch's thread pool, logging.
    Code that draws random numbers while training (dropout) is not deterministic here.
    """

    def __init__(self, size: int, timeout_s: float = 300.0) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout_s)  # a rank that never comes fails the test, not hangs it
        self._slots: list[torch.Tensor | None] = [None] * size
        self.ranks = [ThreadCollectives(self, rank) for rank in range(size)]
        self.aborted: int | None = None

    def exchange(self, rank: int, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order."""
        self.ranks[rank].entered.set()
        self._slots[rank] = mine.detach().clone()
        self._barrier.wait()
        everyone = [t for t in self._slots if t is not None]
        self._barrier.wait()  # no rank refills its slot before every rank has read them all
        return everyone

    def abort(self, code: int) -> None:
        self.aborted = code
        self._barrier.abort()  # the others' waits raise BrokenBarrierError instead of hanging

    def run(self, work: Callable[[ThreadCollectives], T]) -> list[T]:
        """work(comm) on every rank in a thread of its own; the results in rank order. A rank's
        exception aborts the world and is raised here (the first rank's that failed)."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def rank_main(comm: ThreadCollectives) -> None:
            try:
                results[comm.rank] = work(comm)
            except BaseException as err:  # handed to the caller below, after the others stopped
                errors[comm.rank] = err
                comm.abort(1)
            finally:
                comm.entered.set()

        threads = []
        for comm in self.ranks:
            thread = threading.Thread(target=rank_main, args=(comm,), name=f"rank-{comm.rank}", daemon=True)
            thread.start()
            threads.append(thread)
            comm.entered.wait()  # serial set-up: see the class docstring
        for thread in threads:
            thread.join()
        first = next((err for err in errors if err is not None and not isinstance(err, threading.BrokenBarrierError)), None)
        first = first or next((err for err in errors if err is not None), None)
        if first is not None:
            raise first
        return results


class ThreadCollectives:
    """One rank of a ThreadWorld. Async collectives run at once (all ranks issue them in the
    same order, as every backend requires), so their handles are already finished."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self._world = world
        self.rank, self.world_size = rank, world.size
        self.device = torch.device("cpu")
        self.entered = threading.Event()  # set at this rank's first collective (or its end)

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        parts = self._world.exchange(self.rank, buffer)
        if op in ("max", "min"):
            stacked = torch.stack(parts)
            reduced = stacked.amax(dim=0) if op == "max" else stacked.amin(dim=0)
        else:
            reduced = parts[0].clone()
            for part in parts[1:]:
                reduced += part
            if op == "avg":
                reduced /= self.world_size
        buffer.copy_(reduced)

    def allreduce_async(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> Deferred:
        self.allreduce_(buffer, op)
        return Deferred.of()

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.reshape(-1) for part in self._world.exchange(self.rank, mine)])

    def allgather_async(self, mine: torch.Tensor) -> Deferred:
        return Deferred.of(self.allgather(mine))

    def reduce_scatter_async(self, buffer: torch.Tensor) -> Deferred:
        return Deferred.of(reduce_scatter_by_allreduce(self, buffer))

    def broadcast_(self, buffer: torch.Tensor, root: int = 0) -> None:
        buffer.copy_(self._world.exchange(self.rank, buffer)[root])

    def barrier(self) -> None:
        self._world.exchange(self.rank, torch.zeros(0))

    def abort(self, code: int = 1) -> None:
        self._world.abort(code)

    def close(self) -> None:
        return None
