"""ZeRO on the toolkit's engine: each rank keeps and updates the optimizer state of its shard of
the parameters only (comm.sharding=optimizer, ZeRO stage 1), and with sharding=gradients also
receives only its shard of the averaged gradients, reduce-scattered instead of all-reduced
(stage 2). The updated shards are all-gathered, so every rank holds the whole model for forward.

    optimizer = shard_optimizer(torch.optim.AdamW(model.parameters()), model, comm, cfg, stage=2)

The layout: parameters in backward's order are packed into fusion buckets (comm.bucket_mb, as
for the allreduce); each bucket is padded to a multiple of the world size and rank r owns its
r-th equal slice, so every rank holds about 1/world of every bucket, and a bucket's
reduce-scatter starts during backward as soon as its gradients are ready. A parameter can be
split between ranks: each rank's part of it is a `Piece`, a view into the parameter itself, and
the inner optimizer (a second instance of the user's optimizer class, same param groups) steps
on those views. That is exact only for optimizers whose update is elementwise (SGD, Adam(W),
RMSprop, ...): a per-tensor norm (LAMB, Adafactor) would see a piece, so others are refused.

The saved form of a rank's shard names each piece by parameter index (the numbering of the
optimizer's state_dict) and element range, so a checkpoint reshards to any world size, bucket
size or sharding mode, and a replicated optimizer's state converts into pieces and back
(`fill_pieces`, `full_state`).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from collectives.config import CommConfig
from collectives.optimizer import _DistributedOptimizer, _split_by_dtype, plan_buckets

# Optimizers whose update of an element depends on that element's gradient and state only.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
STAGES = {"optimizer": 1, "gradients": 2}
IN_FLIGHT = 2  # buckets packed and on the wire at once: enough to overlap, a bucket's memory each


class ShardingError(ValueError):
    """A model, optimizer or checkpoint sharding cannot work with; the message says why."""


@dataclass
class Piece:
    """This rank's part of one parameter: elements [start, stop) of its flat view."""

    index: int  # the parameter's number in the optimizer's param groups (state_dict's numbering)
    param: nn.Parameter
    start: int
    stop: int
    shard_offset: int  # where the piece lies in this rank's slice of its bucket
    view: nn.Parameter  # what the inner optimizer steps on: a view into `param`


@dataclass
class ShardBucket:
    params: list[nn.Parameter]  # in backward's order
    offsets: list[int]  # each parameter's first element in the bucket
    chunk: int  # elements per rank (the bucket padded to world * chunk)
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)  # this rank's
    shard_grad: torch.Tensor | None = None  # stage 2: this rank's slice of the averaged gradients
    pending: int = 0
    handle: Any = None


def _unpack_gathered(bucket: ShardBucket, handle: Any) -> None:
    gathered = handle.wait()
    with torch.no_grad():
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            p.view(-1).copy_(gathered[offset : offset + p.numel()])


def layout(params: list[nn.Parameter], index_of: dict[nn.Parameter, int], bucket_bytes: int, rank: int, world: int) -> list[ShardBucket]:
    """The buckets of `params` (given in backward's order) and this rank's pieces of each."""
    buckets: list[ShardBucket] = []
    for members in plan_buckets([p.numel() * p.element_size() for p in params], bucket_bytes):
        for group in _split_by_dtype([params[i] for i in members]):
            offsets, total = [], 0
            for p in group:
                offsets.append(total)
                total += p.numel()
            chunk = max(1, math.ceil(total / world))
            bucket = ShardBucket(group, offsets, chunk, group[0].dtype)
            lo, hi = rank * chunk, (rank + 1) * chunk
            for p, offset in zip(group, offsets, strict=True):
                start, stop = max(lo, offset) - offset, min(hi, offset + p.numel()) - offset
                if stop > start:
                    view = nn.Parameter(p.detach().view(-1)[start:stop])
                    bucket.pieces.append(Piece(index_of[p], p, start, stop, offset + start - lo, view))
            buckets.append(bucket)
    return buckets


class BufferRing:
    """IN_FLIGHT + 1 flat buffers per dtype, used in turn and kept between steps: a packed bucket
    waits in one while at most IN_FLIGHT others are on the wire, and no step allocates (an
    allocation of a bucket's size costs page faults every time where the allocator maps it)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        self._next: dict[torch.dtype, int] = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        ring = self._buffers.setdefault(dtype, [])
        turn = self._next.get(dtype, 0)
        self._next[dtype] = (turn + 1) % (IN_FLIGHT + 1)
        if turn == len(ring):
            ring.append(torch.empty(numel, dtype=dtype))
        if ring[turn].numel() < numel:
            ring[turn] = torch.empty(numel, dtype=dtype)
        return ring[turn][:numel]


class _ZeroOptimizer(_DistributedOptimizer):
    """Mixed into the user's optimizer class (shard_optimizer): its param groups (the schedule's,
    the grad scaler's) stay the whole parameters; its `state` stays empty; the inner optimizer
    holds the shard's state."""

    def _init_zero(self, comm: Any, model: nn.Module, cfg: CommConfig, stage: int, backward_passes_per_step: int) -> None:
        params_in_groups = [p for group in self.param_groups for p in group["params"]]  # type: ignore[attr-defined]
        index_of = {p: i for i, p in enumerate(params_in_groups)}
        trained = [p for p in model.parameters() if p.requires_grad]
        missing = [p for p in params_in_groups if p.requires_grad and p not in set(trained)]
        if missing:
            raise ShardingError("comm.sharding: the optimizer holds parameters that are not the model's; give it the model's parameters")
        for name, p in model.named_parameters():
            if p.requires_grad and not p.is_contiguous():
                raise ShardingError(f"comm.sharding: parameter {name} is not contiguous (channels_last?); sharding needs contiguous parameters")
        self._stage = stage
        if stage == 1:  # the gradients: the engine's allreduce (buckets, overlap, compression)
            self._init_distributed(comm, model, cfg, backward_passes_per_step)
            self._release_packed = True
            for hook in self._hooks[-2:]:  # its step hooks: the shards' step hook synchronizes itself
                hook.remove()
            self._hooks = self._hooks[:-2]
        else:
            self._comm, self._passes_per_step = comm, backward_passes_per_step
            self._passes: dict[nn.Parameter, int] = {}
            self._synchronized, self.comm_wait_s = False, 0.0
        own = [p for p in trained if p in index_of][::-1]  # backward's order
        self._zero_buckets = layout(own, index_of, int(cfg.bucket_mb * 2**20), comm.rank, comm.world_size)
        self._zero_bucket_of = {p: b for b in self._zero_buckets for p in b.params}
        self._pieces = [piece for bucket in self._zero_buckets for piece in bucket.pieces]
        if stage == 2:
            for bucket in self._zero_buckets:
                bucket.shard_grad = torch.zeros(bucket.chunk, dtype=bucket.dtype)
                for piece in bucket.pieces:
                    piece.view.grad = bucket.shard_grad[piece.shard_offset : piece.shard_offset + piece.stop - piece.start]
            self._hooks = [p.register_post_accumulate_grad_hook(self._shard_grad_ready) for p in own] if cfg.overlap else []
            self._reset_shard_step()
        self._inner = self._make_inner()
        self._send_ring, self._gather_ring = BufferRing(), BufferRing()
        self._hooks.append(self.register_step_pre_hook(lambda optimizer, args, kwargs: optimizer._step_shards(args, kwargs)))  # type: ignore[attr-defined]
        self._hooks.append(self.register_step_post_hook(lambda optimizer, args, kwargs: setattr(optimizer, "_synchronized", False)))  # type: ignore[attr-defined]

    def _make_inner(self) -> torch.optim.Optimizer | None:
        base = next(c for c in type(self).__mro__ if c in ELEMENTWISE)
        groups = []
        for group in self.param_groups:  # type: ignore[attr-defined]
            members = {id(p) for p in group["params"]}
            views = [piece.view for piece in self._pieces if id(piece.param) in members]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": views})
        if not any(g["params"] for g in groups):
            return None  # a model too small to give this rank any element: it only gathers
        accepted = set(inspect.signature(base.__init__).parameters)
        defaults = {k: v for k, v in self.defaults.items() if k in accepted}  # type: ignore[attr-defined]
        inner = base([g for g in groups if g["params"]] or groups, **defaults)
        self._inner_groups = [i for i, g in enumerate(groups) if g["params"]]
        return inner

    # --- stage 2: gradients reduce-scattered ---------------------------------------------------

    def _reset_shard_step(self) -> None:
        self._next_bucket = 0
        self._in_flight: list[ShardBucket] = []
        self._complete: set[int] = set()
        self._passes.clear()
        for bucket in self._zero_buckets:
            bucket.pending = len(bucket.params)

    def _shard_grad_ready(self, param: nn.Parameter) -> None:
        if not self._last_pass(param):
            return  # an accumulation micro-step: no communication
        bucket = self._zero_bucket_of[param]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._complete.add(id(bucket))
            self._launch_shards()

    def _launch_shards(self, everything: bool = False) -> None:
        """Reduce-scatter the ready buckets in order (every rank launches them in the same order);
        a bucket's whole gradients are let go of as soon as they are packed, and at most
        IN_FLIGHT packed buckets wait for the wire (each is a bucket's size of memory)."""
        world = self._comm.world_size
        while self._next_bucket < len(self._zero_buckets):
            bucket = self._zero_buckets[self._next_bucket]
            if not everything and id(bucket) not in self._complete:
                return
            send = self._send_ring.take(bucket.chunk * world, bucket.dtype)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                part = send[offset : offset + p.numel()]
                if p.grad is None:
                    part.zero_()
                else:
                    torch.mul(p.grad.reshape(-1), 1.0 / world, out=part)  # pre-averaged: the sum is the mean
                    p.grad = None
            send[bucket.offsets[-1] + bucket.params[-1].numel() :].zero_()  # the padding
            bucket.handle = self._comm.reduce_scatter_async(send)
            self._in_flight.append(bucket)
            self._next_bucket += 1
            while len(self._in_flight) > IN_FLIGHT:
                self._finish_shard(self._in_flight.pop(0))

    def _finish_shard(self, bucket: ShardBucket) -> None:
        assert bucket.shard_grad is not None
        bucket.shard_grad.copy_(bucket.handle.wait().reshape(-1))
        bucket.handle = None

    # --- the step -------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Averaged gradients where the step reads them: the whole gradients (stage 1), or this
        rank's slice of them (stage 2). Once per step."""
        if self._stage == 1:
            super().synchronize()
            return
        if self._synchronized:
            return
        started = time.perf_counter()
        self._launch_shards(everything=True)
        while self._in_flight:
            self._finish_shard(self._in_flight.pop(0))
        self._reset_shard_step()
        self._synchronized = True
        self.comm_wait_s += time.perf_counter() - started

    def _step_shards(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The step itself, run by a step pre-hook: it runs for callers holding the base class's
        step too (an LR scheduler made before sharding wraps that one). The base step that
        follows finds no gradients on the whole parameters and changes nothing."""
        if args[1:] or kwargs.get("closure") is not None:  # args[0] is the optimizer itself
            raise ShardingError("comm.sharding: step(closure) is not supported (LBFGS-like optimizers are not elementwise)")
        self.synchronize()
        if self._inner is not None:
            if self._stage == 1:
                for piece in self._pieces:
                    grad = piece.param.grad
                    piece.view.grad = None if grad is None else grad.detach().reshape(-1)[piece.start : piece.stop]
            for inner_group, outer in zip(self._inner.param_groups, (self.param_groups[i] for i in self._inner_groups), strict=True):  # type: ignore[attr-defined]
                inner_group.update({k: v for k, v in outer.items() if k != "params"})  # the schedule's lr, changed hyperparameters
            self._inner.step()
        self.gather_parameters()
        for group in self.param_groups:  # type: ignore[attr-defined]
            for p in group["params"]:
                p.grad = None  # the base step must not update again (stage 1's whole gradients)

    def gather_parameters(self) -> None:
        """Every rank's updated slices to every rank, bucket by bucket, IN_FLIGHT buckets ahead
        (all at once would hold a second copy of the whole model)."""
        if self._comm.world_size == 1:
            return
        pending: list[tuple[ShardBucket, Any]] = []
        for bucket in self._zero_buckets:
            send = self._gather_ring.take(bucket.chunk, bucket.dtype)
            send.zero_()  # where this rank owns less than its slice (the padding, a model smaller than the world)
            for piece in bucket.pieces:
                send[piece.shard_offset : piece.shard_offset + piece.stop - piece.start].copy_(piece.view.detach())
            pending.append((bucket, self._comm.allgather_async(send)))
            if len(pending) > IN_FLIGHT:
                _unpack_gathered(*pending.pop(0))
        for bucket, handle in pending:
            _unpack_gathered(bucket, handle)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self._stage == 1:
            for piece in self._pieces:
                piece.view.grad = None
        self._synchronized = False

    # --- what the loop asks of the gradients ----------------------------------------------------

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's part of the averaged gradients (after synchronize)."""
        if self._stage == 2:
            return [b.shard_grad for b in self._zero_buckets if b.shard_grad is not None]
        return [piece.param.grad.detach().reshape(-1)[piece.start : piece.stop] for piece in self._pieces if piece.param.grad is not None]

    def grads_finite(self) -> bool:
        """Whether every rank's gradient shard is finite (the same answer on every rank)."""
        self.synchronize()
        grads = self.shard_grads()
        local = float(all(bool(torch.isfinite(g).all()) for g in grads))
        flag = torch.tensor([local], dtype=torch.float64)
        self._comm.allreduce_(flag, op="min")
        return bool(flag[0] > 0)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_ over the sharded gradients: the global 2-norm from
        every rank's sum of squares, then each shard scaled by the same factor."""
        self.synchronize()  # once per step: a script may clip right after backward
        if self._stage == 1:  # the whole averaged gradients are here: torch's own, on every rank alike
            params = [p for group in self.param_groups for p in group["params"]]  # type: ignore[attr-defined]
            return float(nn.utils.clip_grad_norm_(params, max_norm))
        grads = self.shard_grads()
        squares = torch.tensor([float(sum(float(g.double().pow(2).sum()) for g in grads))], dtype=torch.float64)
        self._comm.allreduce_(squares, op="sum")
        total = math.sqrt(float(squares[0]))
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1.0:
            for g in grads:
                g.mul_(coefficient)
        return total

    # --- state ---------------------------------------------------------------------------------

    @property
    def shard_tensors(self) -> list[torch.Tensor]:
        """The inner optimizer's state tensors (only its step changes them)."""
        if self._inner is None:
            return []
        return [t for state in self._inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)]

    def shard_state(self) -> dict[str, Any]:
        """This rank's optimizer state as pieces: {"pieces": [{index, start, stop, ranged, whole}]}.
        `ranged`: tensors over the piece's elements; `whole`: per-parameter values (step counts)."""
        pieces = []
        inner_state = self._inner.state if self._inner is not None else {}
        for piece in self._pieces:
            state = inner_state.get(piece.view, {})
            ranged = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == piece.view.shape}
            whole = {k: v for k, v in state.items() if k not in ranged}
            pieces.append({"index": piece.index, "start": piece.start, "stop": piece.stop, "ranged": ranged, "whole": whole})
        return {"pieces": pieces}

    def owns_exactly(self, shard: dict[str, Any]) -> bool:
        """Whether a saved shard holds exactly the pieces this rank owns (same world and buckets)."""
        saved = {(int(p["index"]), int(p["start"]), int(p["stop"])) for p in shard.get("pieces", [])}
        return saved == {(p.index, p.start, p.stop) for p in self._pieces}

    def load_shard_state(self, sources: Iterable[dict[str, Any]]) -> None:
        """This rank's pieces filled from saved pieces (any world size) or a replicated state."""
        if self._inner is None:
            for _ in sources:  # nothing to fill; the sources are still read, as on every rank
                pass
            return
        filled = fill_pieces({piece.index: (piece.start, piece.stop) for piece in self._pieces}, sources)
        for piece in self._pieces:
            state = filled.get(piece.index)
            if state:
                self._inner.state[piece.view] = state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The param groups' hyperparameters; a replicated checkpoint's state is turned into this
        rank's pieces (a sharded one's arrives through load_shard_state)."""
        saved_state = state_dict.get("state") or {}
        super().load_state_dict({**state_dict, "state": {}})  # type: ignore[misc]
        if saved_state:
            self.load_shard_state([pieces_of_replicated(saved_state, self._param_sizes())])

    def _param_sizes(self) -> dict[int, int]:
        return {i: p.numel() for i, p in enumerate(p for group in self.param_groups for p in group["params"])}  # type: ignore[attr-defined]


def pieces_of_replicated(state: dict[Any, dict[str, Any]], sizes: dict[int, int]) -> dict[str, Any]:
    """A replicated optimizer's state_dict()["state"] as one source of whole-parameter pieces."""
    pieces = []
    for key, values in state.items():
        index = int(key)
        n = sizes.get(index)
        if n is None:
            raise ShardingError(f"the checkpoint's optimizer state names parameter {index}; this optimizer has {len(sizes)}")
        ranged = {k: v.reshape(-1) for k, v in values.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel() == n}
        whole = {k: v for k, v in values.items() if k not in ranged}
        pieces.append({"index": index, "start": 0, "stop": n, "ranged": ranged, "whole": whole})
    return {"pieces": pieces}


def fill_pieces(targets: dict[Any, tuple[int, int]], sources: Iterable[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """The state of each target piece (parameter index -> element range) from saved pieces, one
    source (a rank's shard) at a time so only one is in memory. Raises when a range is not covered."""
    states: dict[Any, dict[str, Any]] = {}
    covered: dict[tuple[Any, str], int] = {}
    for source in sources:
        for saved in source.get("pieces", []):
            index = saved["index"]  # a parameter's number (optimizer state) or name (model state)
            if index not in targets:
                continue
            start, stop = targets[index]
            lo, hi = max(start, int(saved["start"])), min(stop, int(saved["stop"]))
            state = states.setdefault(index, {})
            for key, value in saved["whole"].items():
                state.setdefault(key, value.clone() if isinstance(value, torch.Tensor) else value)
            for key, value in saved["ranged"].items():
                if key not in state:  # also where this piece adds nothing: a target with no elements still gets its keys
                    state[key] = torch.zeros(stop - start, dtype=value.dtype)
                if hi <= lo:
                    continue
                state[key][lo - start : hi - start].copy_(value[lo - int(saved["start"]) : hi - int(saved["start"])])
                covered[index, key] = covered.get((index, key), 0) + hi - lo
    for index, state in states.items():
        start, stop = targets[index]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() == stop - start and covered.get((index, key), 0) != stop - start:
                raise ShardingError(
                    f"the checkpoint's shards cover {covered.get((index, key), 0)} of elements {start}..{stop} of parameter {index!r} ({key}); "
                    "its shards are incomplete or of another model"
                )
    return states


def full_state(optimizer: torch.optim.Optimizer, sources: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A replicated optimizer's state (state_dict numbering, parameter shapes) assembled from saved pieces."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    filled = fill_pieces({i: (0, p.numel()) for i, p in enumerate(params)}, sources)

    def shaped(index: int, value: Any) -> Any:
        ranged = isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() == params[index].numel()
        return value.view_as(params[index]) if ranged else value

    return {index: {k: shaped(index, v) for k, v in state.items()} for index, state in filled.items()}


def check_shardable(optimizer: torch.optim.Optimizer, mode: str) -> None:
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ShardingError(f"comm.sharding={mode} shards optimizers whose update is elementwise ({names}); {type(optimizer).__name__} is not one of them")


def shard_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, comm: Any, cfg: CommConfig, stage: int, backward_passes_per_step: int = 1
) -> torch.optim.Optimizer:
    """Return `optimizer` turned into a ZeRO one of a subclass of its own type (stage 1 or 2)."""
    check_shardable(optimizer, {1: "optimizer", 2: "gradients"}[stage])
    loaded = optimizer.state_dict() if optimizer.state else None  # restored already (a resumed script): kept as this rank's pieces
    optimizer.state.clear()
    base = type(optimizer)
    optimizer.__class__ = type(base.__name__, (_ZeroOptimizer, base), {})
    optimizer._init_zero(comm, model, cfg, stage, backward_passes_per_step)  # type: ignore[attr-defined]
    if loaded is not None:
        optimizer.load_state_dict(loaded)
    return optimizer


def is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, _ZeroOptimizer)
