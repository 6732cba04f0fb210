"""The seam between trainers and communication libraries, and helpers built on it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol

import torch

ReduceOp = Literal["sum", "avg", "max", "min"]


class CollectivesError(RuntimeError):
    """A communication setup that cannot work (wrong launcher, missing library)."""


class Collectives(Protocol):
    rank: int
    world_size: int

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        """Reduce a contiguous CPU tensor in place across all ranks."""

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


def allreduce_gradients(comm: Collectives, params: Iterable[torch.nn.Parameter]) -> None:
    """Average gradients over ranks with one fused allreduce (one call, not one per tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    if comm.world_size == 1 or not grads:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = _flat(group)
        comm.allreduce_(flat, op="avg")
        _unflatten_into(flat, group)


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


class FakeCollectives:
    """A world of one process, for unit tests of code that takes a Collectives."""

    rank = 0
    world_size = 1

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        return None

    def broadcast_(self, buffer: torch.Tensor, root: int = 0) -> None:
        return None

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None
