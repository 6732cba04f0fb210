"""The seam between trainers and communication libraries, and helpers built on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

ReduceOp = Literal["sum", "avg", "max", "min"]


class CollectivesError(RuntimeError):
    """A communication setup that cannot work (wrong launcher, missing library)."""


class InFlight(Protocol):
    """A collective started and not yet waited for (the run handle is trainers.handle.Handle)."""

    def wait(self) -> Any:
        """Block until the collective finished; returns its result (allgather) or None."""


class Collectives(Protocol):
    rank: int
    world_size: int
    device: torch.device  # where this rank's model and batches live (its GPU, or the CPU)

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        """Reduce a contiguous CPU tensor in place across all ranks."""

    def allreduce_async(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> InFlight:
        """Start an in-place allreduce; the buffer must not be touched until wait()."""

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's equally sized tensor, concatenated in rank order."""

    def allgather_async(self, mine: torch.Tensor) -> InFlight: ...

    def reduce_scatter_async(self, buffer: torch.Tensor) -> InFlight:
        """Start a sum over ranks of `buffer` (its length a multiple of the world size) of which
        this rank gets chunk `rank` of `world_size` equal chunks; wait() returns that chunk."""

    def broadcast_(self, buffer: torch.Tensor, root: int = 0) -> None:
        """Overwrite a contiguous CPU tensor with root's copy."""

    def barrier(self) -> None: ...

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now: one rank's failure must not leave the others waiting."""

    def close(self) -> None: ...


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def broadcast_module(comm: Collectives, module: torch.nn.Module, root: int = 0, chunk_bytes: int = 16 << 20) -> None:
    """Make every rank start from root's parameters and buffers, in flat chunks of about
    `chunk_bytes` (one flat copy of a large model would add its whole size to every rank's peak)."""
    # A DTensor (FSDP2) holds this rank's rows, not a copy of root's: the ranks' rows are equal as
    # far as they need be (sharded from one initialisation), and root's would be the wrong ones.
    whole = [t for t in [*module.parameters(), *module.buffers()] if type(t).__name__ != "DTensor" and type(t.data).__name__ != "DTensor"]
    tensors = [t.data for t in whole if t.is_floating_point() or isinstance(t, torch.nn.Parameter)]
    if comm.world_size == 1 or not tensors:
        return
    for group in _chunks_by_dtype(tensors, chunk_bytes):
        flat = _flat(group)
        comm.broadcast_(flat, root)
        _unflatten_into(flat, group)


def _chunks_by_dtype(tensors: list[torch.Tensor], chunk_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, up to about chunk_bytes a group (order kept per dtype)."""
    groups: list[list[torch.Tensor]] = []
    open_group: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        members, filled = open_group.get(t.dtype, ([], 0))
        if not members:
            groups.append(members)
        members.append(t)
        filled += t.numel() * t.element_size()
        open_group[t.dtype] = ([], 0) if filled >= chunk_bytes else (members, filled)
    return groups


def reduce_scatter_by_allreduce(comm: Collectives, buffer: torch.Tensor) -> torch.Tensor:
    """A reduce-scatter for backends without one: the whole sum, then this rank's chunk (twice
    the traffic of a real one)."""
    summed = buffer.reshape(-1).clone()
    comm.allreduce_(summed, op="sum")
    return summed.view(comm.world_size, -1)[comm.rank]


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


class SingleProcess:
    """The collectives of a world of one process (a script run without a launcher, a benchmark's
    single rank, unit tests): every collective leaves its buffer as it is."""

    rank = 0
    world_size = 1
    device = torch.device("cpu")
    aborted: int | None = None  # the code abort() was called with: no other rank to end; the caller ends itself

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        return None

    def allreduce_async(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> Deferred:
        return Deferred.of()

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        return mine.reshape(-1).clone()

    def allgather_async(self, mine: torch.Tensor) -> Deferred:
        return Deferred.of(self.allgather(mine))

    def reduce_scatter_async(self, buffer: torch.Tensor) -> Deferred:
        return Deferred.of(buffer.reshape(-1))

    def broadcast_(self, buffer: torch.Tensor, root: int = 0) -> None:
        return None

    def barrier(self) -> None:
        return None

    def abort(self, code: int = 1) -> None:
        self.aborted = code

    def close(self) -> None:
        return None
