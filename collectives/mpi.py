"""The `mpi` backend: collectives on mpi4py over zero-copy views of CPU tensors.

This first version calls MPI_Allreduce / MPI_Bcast; later issues add the toolkit's own
ring, halving-doubling and hierarchical algorithms behind the same methods.
"""

from __future__ import annotations

import torch

from collectives.base import CollectivesError, ReduceOp

_MPI_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}


def _as_numpy(buffer: torch.Tensor):  # type: ignore[no-untyped-def]
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise CollectivesError("the mpi backend reduces contiguous CPU tensors")
    if buffer.dtype == torch.bfloat16:
        raise CollectivesError("the mpi backend has no bfloat16 reduction yet; reduce in float32")
    return buffer.numpy()  # shares memory with the tensor


class MpiCollectives:
    def __init__(self, comm) -> None:  # type: ignore[no-untyped-def]
        self._comm = comm
        self.rank: int = comm.Get_rank()
        self.world_size: int = comm.Get_size()

    @classmethod
    def from_world(cls) -> MpiCollectives:
        try:
            from mpi4py import MPI
        except ImportError as err:  # mpi4py present but libmpi missing, or not installed
            raise CollectivesError(f"comm=mpi needs mpi4py and an MPI library: {err}") from None
        return cls(MPI.COMM_WORLD)

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        from mpi4py import MPI

        array = _as_numpy(buffer)
        if array.size:
            self._comm.Allreduce(MPI.IN_PLACE, array, op=getattr(MPI, _MPI_OPS[op]))
        if op == "avg":
            buffer.div_(self.world_size)

    def broadcast_(self, buffer: torch.Tensor, root: int = 0) -> None:
        array = _as_numpy(buffer)
        if array.size:
            self._comm.Bcast(array, root=root)

    def barrier(self) -> None:
        self._comm.Barrier()

    def close(self) -> None:
        # mpi4py finalizes MPI at exit; nothing to tear down per communicator of the world.
        return None
