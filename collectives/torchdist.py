"""Collectives on torch.distributed (Gloo on CPU, NCCL on GPU), for comm=gloo and comm=nccl.

The rendezvous comes from the launcher, never from the user (hpc.env.rendezvous: under Slurm
the first host of the job's node list and a port derived from the job id; under the local
launcher, MASTER_ADDR/MASTER_PORT exported by it). Gradients themselves go
through DistributedDataParallel (collectives/gradsync.py); this class carries what the trainer
reduces besides them (losses, counts, the stop vote, BatchNorm statistics) and broadcasts.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import time

import torch
import torch.distributed as dist

from collectives.base import CollectivesError, Deferred, ReduceOp, reduce_scatter_by_allreduce

_ABANDONED: list[torch.Tensor] = []  # lent to the work of a group whose peers are gone: never freed by a worker thread


def held_elsewhere(tensor: torch.Tensor) -> bool:
    """True while C++ (a backend's worker thread) holds a reference to the tensor besides its Python object's."""
    use_count: int = tensor._use_count()  # type: ignore[attr-defined]  # torch's own, untyped
    return use_count > 1


def end_process_group() -> None:
    """End a script's default process group, its worker threads done with the script's last
    collectives first; every rank calls it, after its last collective (a barrier).

    Gloo's threads outlive destroy_process_group(): they end with the group's last reference,
    which FSDP2's device mesh and DDP keep until the interpreter's exit. A thread lets go of a
    collective's tensors after the caller's wait returned; a tensor made in Python needs the GIL
    for that, and during the interpreter's exit the thread is ended instead and the process
    aborts ("terminate called without an active exception"; seen after FSDP2's full_tensor()).
    Gloo's barrier holds a weak reference to each collective not yet let go of, which defers the
    collective's destructor (its tensors) to the barrier's own; the barrier is kept to the
    process's end, so no thread frees those tensors (the few bytes are the OS's at exit)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    work = dist.barrier(async_op=True)
    if work is not None:
        work.wait()
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))  # kept: not even the interpreter's exit frees it
    dist.destroy_process_group()


class TorchDistCollectives:
    def __init__(self, backend: str, device: torch.device) -> None:
        """Over the process group already started (`start`, or a user's script's own)."""
        self.backend, self.device = backend, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Tensors an asynchronous collective handed to the backend's worker threads, kept until
        # those threads let go of them (quiesce). A worker drops its reference just after the
        # work completes; were that the last one, it would free a Python tensor from a thread
        # that must take the GIL, and during interpreter exit that aborts the process
        # ("terminate called without an active exception", seen after a script's last step).
        self._lent: list[torch.Tensor] = []
        self._abandoned = False
        _ABANDONED[:] = [t for t in _ABANDONED if held_elsewhere(t)]  # an earlier group's, let go of since: freed here

    def _lend(self, *tensors: torch.Tensor) -> None:
        self._lent = [t for t in self._lent if held_elsewhere(t)]  # let go of: ours alone now
        self._lent.extend(tensors)

    def quiesce(self, timeout_s: float = 5.0) -> None:
        """Wait until the backend's threads hold none of the tensors lent to them (polling their
        reference counts: a worker lets go microseconds after the work completes, or when it is
        next scheduled), then let go of them here, on a thread that holds the GIL."""
        deadline = time.monotonic() + timeout_s
        while any(held_elsewhere(t) for t in self._lent) and time.monotonic() < deadline:
            time.sleep(0.001)
        self._lent = []

    @classmethod
    def start(cls, backend: str, rank: int, world_size: int, address: str, port: int, timeout_s: float = 600.0) -> TorchDistCollectives:
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise CollectivesError("comm=nccl needs a GPU on every rank and this one sees none; use comm=gloo or comm=mpi")
            torch.cuda.set_device(0)  # the binding left exactly this rank's GPU visible
        elif not dist.is_gloo_available():
            raise CollectivesError("this torch build has no Gloo; use comm=mpi")
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return cls(backend, torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu"))

    @classmethod
    def joined(cls) -> TorchDistCollectives:
        """The default process group a user's script started (the run handle votes through it)."""
        backend = str(dist.get_backend())
        return cls(backend, torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu"))

    # --- the Collectives interface (CPU tensors in, CPU tensors out) -------------------------

    def _on_device(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer if buffer.device == self.device else buffer.to(self.device)

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        self.allreduce_async(buffer, op).wait()

    def allreduce_async(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> Deferred:
        work = self._on_device(buffer)
        reduce_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        handle = dist.all_reduce(work, op=reduce_op, async_op=True)
        self._lend(work)

        def finish() -> None:
            if op == "avg":
                work.div_(self.world_size)
            if work is not buffer:
                buffer.copy_(work)

        def wait_then_finish() -> None:
            handle.wait()
            finish()

        return Deferred(wait_then_finish)

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        return self.allgather_async(mine).wait()

    def allgather_async(self, mine: torch.Tensor) -> Deferred:
        work = self._on_device(mine.contiguous())
        parts = [torch.empty_like(work) for _ in range(self.world_size)]
        handle = dist.all_gather(parts, work, async_op=True)
        self._lend(work, *parts)
        return Deferred(lambda: (handle.wait(), torch.cat(parts).to(mine.device))[1])

    def reduce_scatter_async(self, buffer: torch.Tensor) -> Deferred:
        return Deferred.of(reduce_scatter_by_allreduce(self, buffer))

    def broadcast_(self, buffer: torch.Tensor, root: int = 0) -> None:
        work = self._on_device(buffer)
        dist.broadcast(work, src=root)
        if work is not buffer:
            buffer.copy_(work)

    def barrier(self) -> None:
        dist.barrier()

    def abort(self, code: int = 1) -> None:
        """End this process at once; the launcher (srun --kill-on-bad-exit, mpirun) ends the rest."""
        os._exit(code)

    def abandon(self) -> None:
        """Its peers are gone and this process lives on (an in-process restart): close() waits for
        no worker thread to let go of a tensor (their work failed, and a failed work keeps its
        tensors while its exception lives); they are kept to the process's end instead."""
        self._abandoned = True

    def close(self) -> None:
        if self._abandoned:  # only what a worker thread still holds; the rest is freed here
            _ABANDONED[:] = [t for t in [*_ABANDONED, *self._lent] if held_elsewhere(t)]
            self._lent = []
        self.quiesce()
        if dist.is_initialized():
            dist.destroy_process_group()
