"""The seam between trainers and communication libraries, and helpers built on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

ReduceOp = Literal["sum", "avg", "max", "min"]


class CollectivesError(RuntimeError):
    """A communication setup that cannot work (wrong launcher, missing library)."""


class Handle(Protocol):
    def wait(self) -> Any:
        """Block until the collective finished; returns its result (allgather) or None."""


class Collectives(Protocol):
    rank: int
    world_size: int

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        """Reduce a contiguous CPU tensor in place across all ranks."""

    def allreduce_async(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> Handle:
        """Start an in-place allreduce; the buffer must not be touched until wait()."""

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's equally sized tensor, concatenated in rank order."""

    def allgather_async(self, mine: torch.Tensor) -> Handle: ...

    def broadcast_(self, buffer: torch.Tensor, root: int = 0) -> None:
        """Overwrite a contiguous CPU tensor with root's copy."""

    def barrier(self) -> None: ...

    def close(self) -> None: ...


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def broadcast_module(comm: Collectives, module: torch.nn.Module, root: int = 0) -> None:
    """Make every rank start from root's parameters and buffers."""
    tensors = [t.data for t in module.parameters()] + [b for b in module.buffers() if b.is_floating_point()]
    if comm.world_size == 1 or not tensors:
        return
    flat = _flat(tensors)
    comm.broadcast_(flat, root)
    _unflatten_into(flat, tensors)


def allreduce_sums(comm: Collectives, values: list[float]) -> list[float]:
    """Sum a few scalars (loss sums, counts) over ranks in one call."""
    buffer = torch.tensor(values, dtype=torch.float64)
    comm.allreduce_(buffer, op="sum")
    return buffer.tolist()


class Deferred:
    """A started collective, as every backend returns it: the first wait() calls `finish`
    (which blocks until the result is there and returns it), later calls return the same."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish: Callable[[], Any] | None = finish
        self._result: Any = None

    def wait(self) -> Any:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result

    @classmethod
    def of(cls, result: Any = None) -> Deferred:
        """Already finished (a world of one, or a collective that ran synchronously)."""
        return cls(lambda: result)


class FakeCollectives:
    """A world of one process, for unit tests of code that takes a Collectives."""

    rank = 0
    world_size = 1

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        return None

    def allreduce_async(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> Deferred:
        return Deferred.of()

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        return mine.reshape(-1).clone()

    def allgather_async(self, mine: torch.Tensor) -> Deferred:
        return Deferred.of(self.allgather(mine))

    def broadcast_(self, buffer: torch.Tensor, root: int = 0) -> None:
        return None

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None
