"""How gradients are made equal on every rank, per backend, behind one small interface.

comm=mpi: our distributed optimizer (fusion buckets, overlap hooks, compression).
comm=gloo / nccl: DistributedDataParallel (bucket size, fp16/bf16 compression hooks).
comm=horovod: Horovod's DistributedOptimizer (compression, backward_passes_per_step).
A world of one rank (replicated): none of them, the model and optimizer as they are.

Gradient accumulation never communicates on micro-steps: `micro_step(last=False)` wraps the
forward and backward of every micro-batch but the last of a step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from collectives.backends import entry, sharding_refused
from collectives.base import Collectives
from collectives.config import CommConfig
from collectives.optimizer import apply_distributed_optimizer
from collectives.replicated import ReplicatedGradients


class GradientSync(Protocol):
    @property
    def module(self) -> nn.Module:
        """Call this for forward (the model itself, or its DDP wrapper)."""

    optimizer: torch.optim.Optimizer

    @property
    def comm_wait_s(self) -> float:
        """Seconds step() has waited for gradient communication so far (0 where it is hidden in backward)."""

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[None]: ...

    def synchronize(self) -> None:
        """Make gradients the average over ranks now (before clipping or unscaling them)."""

    def step_context(self) -> contextlib.AbstractContextManager[None]:
        """Around optimizer.step() after synchronize()."""

    def nonfinite(self, model: nn.Module) -> torch.Tensor:
        """1.0 where the averaged gradients hold an inf or NaN, else 0.0 (the same on every rank):
        a 0-dim tensor, on the gradients' device where the backend can keep it there."""

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor | float:
        """Scale the averaged gradients to a global 2-norm of at most max_norm; the norm before
        (a tensor where it stays on the device)."""

    def close(self) -> None: ...


class LocalGradients(ReplicatedGradients):
    """A world of one rank: its gradients are already the average. No wrapper, no hooks, no
    bucket copies, whatever the backend (DDP's reducer alone costs a step a few percent on a GPU)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = model, optimizer

    @property
    def comm_wait_s(self) -> float:
        return 0.0

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass

    def step_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class MpiSync(ReplicatedGradients):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, cfg: CommConfig, accumulation: int) -> None:
        self.module = model
        self.optimizer = apply_distributed_optimizer(optimizer, model, comm, cfg, accumulation)

    @property
    def comm_wait_s(self) -> float:
        return float(self.optimizer.comm_wait_s)  # type: ignore[attr-defined]

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # its hooks count backward passes themselves

    def synchronize(self) -> None:
        self.optimizer.synchronize()  # type: ignore[attr-defined]

    def step_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # step() knows the gradients are already averaged

    def close(self) -> None:
        self.optimizer.remove_hooks()  # type: ignore[attr-defined]


class DdpSync(ReplicatedGradients):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, cfg: CommConfig) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        device = comm.device
        # broadcast_buffers=False: BatchNorm statistics stay per rank and are averaged before
        # evaluation, as with the other backends (parity), instead of rank 0's every forward.
        options: dict[str, Any] = {
            "device_ids": [device.index] if device.type == "cuda" else None,
            "bucket_cap_mb": cfg.bucket_mb if cfg.bucket_mb > 0 else 25.0,
        }
        try:  # newer torch renamed the option (buffers are already equal at start: broadcast_module)
            self.module = DistributedDataParallel(model, forward_sync_buffers=False, **options)
        except TypeError:
            self.module = DistributedDataParallel(model, broadcast_buffers=False, **options)
        hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        if cfg.compression in hooks:
            self.module.register_comm_hook(None, hooks[cfg.compression])
        self.optimizer = optimizer

    @property
    def comm_wait_s(self) -> float:
        return 0.0  # DDP overlaps with backward and waits inside it

    @contextlib.contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        if last:
            yield
        else:
            with self.module.no_sync():
                yield

    def synchronize(self) -> None:
        pass  # DDP has averaged the gradients by the end of backward

    def step_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class ZeroSync(MpiSync):
    """comm.sharding=optimizer|gradients on our engine: the optimizer state (and the gradients)
    sharded over the ranks; clipping and the finite check run over the shards."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, cfg: CommConfig, accumulation: int) -> None:
        from collectives.zero import STAGES, shard_optimizer

        self.module = model
        self.optimizer = shard_optimizer(optimizer, model, comm, cfg, STAGES[cfg.sharding], accumulation)

    def nonfinite(self, model: nn.Module) -> torch.Tensor:
        return torch.tensor(0.0 if self.optimizer.grads_finite() else 1.0)  # type: ignore[attr-defined]  # agreed over the shards on the host

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        return float(self.optimizer.clip_grad_norm_(max_norm))  # type: ignore[attr-defined]


def build_gradient_sync(model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, cfg: CommConfig, accumulation: int) -> GradientSync:
    """The gradient sync of the backend's entry (collectives.backends) for comm.sharding."""
    backend = entry(cfg.backend)
    if cfg.sharding not in backend.shardings:
        raise ValueError(sharding_refused(cfg.sharding, backend.name))
    if cfg.sharding == "full":
        from collectives.fsdp import FsdpSync

        return FsdpSync(model, optimizer, comm)
    if cfg.sharding in ("optimizer", "gradients"):  # a world of one too: its checkpoints keep the sharded layout
        return ZeroSync(model, optimizer, comm, cfg, accumulation)
    if comm.world_size == 1:
        return LocalGradients(model, optimizer)
    if backend.family == "torch.distributed":
        return DdpSync(model, optimizer, comm, cfg)
    if backend.family == "horovod":
        from collectives.horovod import HorovodSync

        return HorovodSync(model, optimizer, cfg, accumulation)
    return MpiSync(model, optimizer, comm, cfg, accumulation)
