"""A Horovod-like distributed optimizer on our collectives: fusion buckets, overlap, accumulation,
compression.

    optimizer = apply_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm, cfg)
    isinstance(optimizer, torch.optim.SGD)   # True: the wrapped optimizer keeps its type

Gradients are packed into buckets of about `bucket_mb` in reverse registration order (the order
backward produces them). With overlap, a post-accumulate-grad hook marks a parameter ready; a
bucket's allreduce starts as soon as it and every earlier bucket are complete, so all ranks
launch buckets in the same order. `step()` waits for the rest, averages and steps. With
`backward_passes_per_step = k`, the first k-1 backward passes only accumulate locally.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from collectives.config import COMPRESSIONS, CommConfig


def plan_buckets(sizes_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Group consecutive tensors (given in launch order) into buckets of >= bucket_bytes;
    bucket_bytes <= 0 puts every tensor in a bucket of its own."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, size in enumerate(sizes_bytes):
        current.append(index)
        filled += size
        if bucket_bytes <= 0 or filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # the bucket's gradients, flat
    pending: int = 0  # parameters not yet ready this step
    handles: list[Any] = field(default_factory=list)
    wire: Any = None  # what was sent: a compressed tensor, or (indices, values) for topk
    residual: torch.Tensor | None = None  # topk error feedback

    def pack(self, scale: float = 1.0, release: bool = False) -> None:
        """Gradients into the bucket, times `scale` in the same pass (pre-averaging: dividing the
        sum afterwards would cost another pass over the bucket). `release`: let go of autograd's
        gradient tensors once packed (unpack() points the gradients at the bucket; holding both
        until then adds the whole gradients' size to the step's peak), so until synchronize()
        the parameters show no gradient."""
        offset = 0
        for p in self.params:
            n = p.numel()
            part = self.buffer[offset : offset + n]
            if p.grad is None:
                part.zero_()
            elif p.grad.data_ptr() == part.data_ptr():  # already the bucket's view (unpack; zero_grad(set_to_none=False))
                if scale != 1.0:
                    part.mul_(scale)
            else:
                torch.mul(p.grad.reshape(-1), scale, out=part)
                if release:
                    p.grad = None
            offset += n

    def unpack(self) -> None:
        """Every gradient becomes its slice of the bucket (no copy back): the optimizer steps on
        the averaged values where they lie; zero_grad(set_to_none=True) lets go of them."""
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = self.buffer[offset : offset + n].view_as(p)
            offset += n


class Compressor:
    """What travels for a bucket: the buffer itself, a half-precision copy, or its top-k."""

    def __init__(self, kind: str, topk_ratio: float, world_size: int) -> None:
        if kind not in COMPRESSIONS:
            raise ValueError(f"comm.compression={kind!r} is not one of {', '.join(COMPRESSIONS)}")
        if kind == "topk" and not 0 < topk_ratio <= 1:
            raise ValueError(f"comm.topk_ratio={topk_ratio} must be in (0, 1]")
        self.kind, self.topk_ratio, self.world_size = kind, topk_ratio, world_size

    def launch(self, comm: Any, bucket: Bucket) -> None:
        buf = bucket.buffer
        if self.kind == "none":  # packed pre-scaled by 1/world: the sum is the average
            bucket.wire = buf
            bucket.handles = [comm.allreduce_async(buf, op="sum")]
        elif self.kind in ("fp16", "bf16"):
            half = torch.float16 if self.kind == "fp16" else torch.bfloat16
            bucket.wire = (buf / self.world_size).to(half)  # pre-scaled: the sum cannot overflow
            bucket.handles = [comm.allreduce_async(bucket.wire, op="sum")]
        else:
            indices, values = self.select_topk(bucket)
            bucket.wire = (indices, values)
            bucket.handles = [comm.allgather_async(indices), comm.allgather_async(values)]

    def select_topk(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """Send the k largest magnitudes of gradient + residual; keep the rest as residual."""
        if bucket.residual is None:
            bucket.residual = torch.zeros_like(bucket.buffer)
        corrected = bucket.buffer + bucket.residual
        k = max(1, math.ceil(self.topk_ratio * corrected.numel())) if corrected.numel() else 0
        indices = torch.topk(corrected.abs(), k, sorted=False).indices if k else torch.empty(0, dtype=torch.int64)
        values = corrected[indices]
        corrected[indices] = 0
        bucket.residual = corrected
        return indices, values

    def finish(self, bucket: Bucket) -> None:
        results = [h.wait() for h in bucket.handles]
        if self.kind in ("fp16", "bf16"):
            bucket.buffer.copy_(bucket.wire)
        elif self.kind == "topk":
            all_indices, all_values = results
            bucket.buffer.zero_().index_add_(0, all_indices, all_values).div_(self.world_size)
        bucket.handles, bucket.wire = [], None


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's own class (see apply_distributed_optimizer)."""

    def _init_distributed(self, comm: Any, model: nn.Module, cfg: CommConfig, backward_passes_per_step: int) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        self._comm = comm
        self._passes_per_step = backward_passes_per_step
        self._compressor = Compressor(cfg.compression, cfg.topk_ratio, comm.world_size)
        params = [p for p in model.parameters() if p.requires_grad][::-1]  # backward's order
        plan = plan_buckets([p.numel() * p.element_size() for p in params], int(cfg.bucket_mb * 2**20))
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        for members in plan:
            group = [params[i] for i in members]
            for dtype_group in _split_by_dtype(group):
                bucket = Bucket(len(self._buckets), dtype_group, torch.zeros(sum(p.numel() for p in dtype_group), dtype=dtype_group[0].dtype))
                self._buckets.append(bucket)
                self._bucket_of.update({p: bucket for p in dtype_group})
        self._passes: dict[nn.Parameter, int] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params] if cfg.overlap else []
        # Around the optimizer's own step (torch's public step hooks, not an override): a caller
        # holding the base class's step (an LR scheduler's wrapper made before this) averages too.
        self._hooks.append(self.register_step_pre_hook(lambda optimizer, args, kwargs: optimizer.synchronize()))  # type: ignore[attr-defined]
        self._hooks.append(self.register_step_post_hook(lambda optimizer, args, kwargs: setattr(optimizer, "_synchronized", False)))  # type: ignore[attr-defined]
        self._reset_step()
        self._synchronized = False  # gradients of this step already averaged (clipping, AMP unscale)
        self._release_packed = False  # ZeRO-1 (collectives/zero.py) lets go of packed gradients
        self.comm_wait_s = 0.0  # time step() spent finishing communication (not hidden)

    def _reset_step(self) -> None:
        self._next_bucket = 0
        self._complete: set[int] = set()
        self._passes.clear()
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)

    def _last_pass(self, param: nn.Parameter) -> bool:
        """Count a backward pass of `param`; True on the step's last (backward_passes_per_step)."""
        passes = self._passes.get(param, 0) + 1
        self._passes[param] = passes
        return passes == self._passes_per_step

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._last_pass(param) or self._comm.world_size == 1:
            return  # an accumulation micro-step: no communication
        bucket = self._bucket_of[param]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._complete.add(bucket.index)
            self._launch_in_order()

    def _launch_in_order(self, everything: bool = False) -> None:
        while self._next_bucket < len(self._buckets) and (everything or self._next_bucket in self._complete):
            bucket = self._buckets[self._next_bucket]
            bucket.pack(1.0 / self._comm.world_size if self._compressor.kind == "none" else 1.0, release=self._release_packed)
            self._compressor.launch(self._comm, bucket)
            self._next_bucket += 1

    def synchronize(self) -> None:
        """Start any bucket not yet started, wait for all, and write averaged gradients back.
        Once per step: clipping or a grad scaler may call it before step() does."""
        if self._synchronized:
            return
        started = time.perf_counter()
        if self._comm.world_size > 1:
            self._launch_in_order(everything=True)
            for bucket in self._buckets:
                self._compressor.finish(bucket)
                bucket.unpack()
        self._reset_step()
        self._synchronized = True
        self.comm_wait_s += time.perf_counter() - started

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._synchronized = False  # a step a grad scaler skipped (inf/nan) must not carry over
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _split_by_dtype(params: list[nn.Parameter]) -> Iterable[list[nn.Parameter]]:
    groups: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.dtype, []).append(p)
    return groups.values()


def apply_distributed_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, comm: Any, cfg: CommConfig, backward_passes_per_step: int = 1
) -> torch.optim.Optimizer:
    """Return `optimizer` turned into a distributed one of a subclass of its own type."""
    base = type(optimizer)
    optimizer.__class__ = type(base.__name__, (_DistributedOptimizer, base), {})
    optimizer._init_distributed(comm, model, cfg, backward_passes_per_step)  # type: ignore[attr-defined]
    return optimizer


def broadcast_optimizer_state(comm: Any, optimizer: torch.optim.Optimizer, root: int = 0) -> None:
    """Make every rank's optimizer state (momentum buffers, step counts) equal root's."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for state in (optimizer.state[p] for p in params if p in optimizer.state):
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.numel():
                tensor = value.contiguous()
                comm.broadcast_(tensor, root)
                state[key] = tensor
