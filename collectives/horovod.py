"""comm=horovod: Horovod's DistributedOptimizer for gradients, Horovod collectives for the rest.

Horovod starts from the launcher's environment (srun --mpi=pmix or mpirun) through its MPI
controller; it must be built against this torch (scripts/build-horovod.sh).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from collectives.base import CollectivesError, Deferred, ReduceOp, reduce_scatter_by_allreduce
from collectives.config import CommConfig
from collectives.replicated import ReplicatedGradients


def _hvd() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as err:
        raise CollectivesError(f"comm=horovod but Horovod does not import ({err}); run scripts/build-horovod.sh") from None
    return hvd


class HorovodCollectives:
    def __init__(self, hvd: Any) -> None:
        self._hvd = hvd
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.device = torch.device("cpu")  # as the trainer has always run it with Horovod
        self._count = 0

    @classmethod
    def start(cls, fusion_mb: float) -> HorovodCollectives:
        hvd = _hvd()
        os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", str(int(fusion_mb * (1 << 20))))  # read by init()
        hvd.init()
        return cls(hvd)

    def _name(self, what: str) -> str:
        self._count += 1  # every rank calls in the same order, so names match across ranks
        return f"hpc.{what}.{self._count}"

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        self.allreduce_async(buffer, op).wait()

    def allreduce_async(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> Deferred:
        hvd = self._hvd
        hvd_op = {"sum": hvd.Sum, "avg": hvd.Average, "max": hvd.Max, "min": hvd.Min}[op]
        handle = hvd.allreduce_async_(buffer, op=hvd_op, name=self._name("allreduce"))
        return Deferred(lambda: hvd.synchronize(handle))

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        return self._hvd.allgather(mine.reshape(1, -1), name=self._name("allgather")).reshape(-1)

    def allgather_async(self, mine: torch.Tensor) -> Deferred:
        result = self.allgather(mine)
        return Deferred.of(result)

    def reduce_scatter_async(self, buffer: torch.Tensor) -> Deferred:
        return Deferred.of(reduce_scatter_by_allreduce(self, buffer))

    def broadcast_(self, buffer: torch.Tensor, root: int = 0) -> None:
        self._hvd.broadcast_(buffer, root_rank=root, name=self._name("broadcast"))

    def barrier(self) -> None:
        self._hvd.allreduce(torch.zeros(1), name=self._name("barrier"))

    def abort(self, code: int = 1) -> None:
        os._exit(code)  # the launcher (srun --kill-on-bad-exit, mpirun) ends the other ranks

    def close(self) -> None:
        self._hvd.shutdown()


class HorovodSync(ReplicatedGradients):
    """Horovod's DistributedOptimizer: it averages gradients in fused buffers during backward
    and skips communication on the first backward_passes_per_step - 1 passes."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: CommConfig, accumulation: int) -> None:
        hvd = _hvd()
        compression = hvd.Compression.fp16 if cfg.compression == "fp16" else hvd.Compression.none
        self.module = model
        self.optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=compression,
            backward_passes_per_step=accumulation,
            op=hvd.Average,
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)

    @property
    def comm_wait_s(self) -> float:
        return 0.0  # waited inside step()'s synchronize; not separated by Horovod

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # backward_passes_per_step counts passes itself

    def synchronize(self) -> None:
        self.optimizer.synchronize()

    def step_context(self) -> contextlib.AbstractContextManager[None]:
        return self.optimizer.skip_synchronize()  # Horovod's documented pattern for clipping/AMP

    def close(self) -> None:
        pass
