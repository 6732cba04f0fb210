"""comm.sharding=full on torch.distributed (gloo, nccl): FSDP2, torch's `fully_shard`, applied per
block and at the root, so parameters, gradients and optimizer state are all split over the ranks
(each parameter by rows, dimension 0) and whole parameters exist only while a block computes.

The shards are saved as pieces (collectives/zero.py's form): a parameter's local rows are the
element range [first row * row size, end row * row size) of its flat view, so a checkpoint
reshards to another world size, or to and from replicated and ZeRO runs, by the same
`fill_pieces`. Only public torch APIs: `fully_shard`, `FSDPModule.set_requires_gradient_sync`,
`DTensor.to_local` / `DTensor.from_local`, `device_mesh`, `placements`.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from collectives.base import Collectives
from collectives.zero import ShardingError, fill_pieces


def is_distributed_tensor(value: Any) -> bool:
    if type(value).__name__ != "DTensor":  # no torch.distributed import for the plain values of every state dict
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_of(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return value.to_local() if is_distributed_tensor(value) else value  # type: ignore[attr-defined]


def shard_model(model: nn.Module, blocks: Iterable[nn.Module]) -> nn.Module:
    """fully_shard each block (its parameters gathered only while it runs), then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        if block is not model:
            fully_shard(block)
    fully_shard(model)
    return model


def row_range(value: Any) -> tuple[int, int]:
    """The rows [start, stop) of a dim-0-sharded DTensor this rank holds (torch.chunk's split)."""
    from torch.distributed.tensor import Shard

    placements = value.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ShardingError(f"a parameter sharded as {placements}; the checkpoint format expects rows (Shard(0)) on one mesh dimension")
    mesh = value.device_mesh
    rows, world, rank = value.shape[0] if value.dim() else 1, mesh.size(), mesh.get_local_rank()
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    stop = min(start + chunk, rows)
    local_rows = value.to_local().shape[0] if value.dim() else 1
    if local_rows != stop - start:
        raise ShardingError(f"this rank holds {local_rows} rows of {rows}, not rows {start}..{stop} as torch.chunk splits them")
    return start, stop


def element_range(value: Any) -> tuple[int, int]:
    start, stop = row_range(value)
    row = value.numel() // max(value.shape[0], 1) if value.dim() else 1
    return start * row, stop * row


def full_model_state(sources: Iterable[dict[str, Any]], shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The whole parameters assembled from every rank's pieces (consolidation, export)."""
    filled = fill_pieces({name: (0, math.prod(int(size) for size in shape)) for name, shape in shapes.items()}, sources)
    return {name: filled[name]["value"].view(shapes[name]) for name in shapes if name in filled}


def load_optimizer_shards(optimizer: torch.optim.Optimizer, sources: Iterable[dict[str, Any]]) -> None:
    """This rank's rows of the optimizer state from saved pieces, as DTensors shaped like the parameters."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    filled = fill_pieces({i: element_range(p) for i, p in enumerate(params)}, sources)
    for index, state in filled.items():
        p = params[index]
        local_shape = p.to_local().shape
        optimizer.state[p] = {
            k: DTensor.from_local(v.view(local_shape).to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel() == p.to_local().numel()
            else v
            for k, v in state.items()
        }


class FsdpSync:
    """The GradientSync of comm.sharding=full: FSDP2 reduce-scatters gradients inside backward."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            raise ShardingError("comm.sharding=full: the model must be sharded (shard_model) before its optimizer is built")
        self.module = model
        self.optimizer = optimizer
        self._comm = comm

    @property
    def comm_wait_s(self) -> float:
        return 0.0  # inside backward

    @contextlib.contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        self.module.set_requires_gradient_sync(last)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def synchronize(self) -> None:
        pass  # FSDP2 has reduce-scattered the gradients by the end of backward

    def step_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def nonfinite(self, model: nn.Module) -> torch.Tensor:
        local = [local_of(p.grad) for p in model.parameters() if p.grad is not None]
        flag = torch.tensor([float(all(bool(torch.isfinite(g).all()) for g in local))], dtype=torch.float64)
        self._comm.allreduce_(flag, op="min")  # every rank's rows: agreed on the host
        return torch.tensor(0.0 if flag[0] > 0 else 1.0)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # DTensor gradients: the norm over every rank's rows
        return float(norm.full_tensor() if is_distributed_tensor(norm) else norm)  # type: ignore[attr-defined]

    def close(self) -> None:
        pass


# --- any object's state dict holding DTensors (a script's FSDP2 model and optimizer, the run handle) ---

SHARDED = "__hpctk_sharded__"  # marks where a DTensor stood in a saved state dict


def split_sharded(state: Any, name: str) -> tuple[Any, list[dict[str, Any]]]:
    """`state` with every DTensor replaced by a marker naming it, and this rank's rows of them
    as pieces keyed by that name (the object's name and the path inside its state dict)."""
    pieces: list[dict[str, Any]] = []

    def walk(value: Any, path: tuple[Any, ...]) -> Any:
        if is_distributed_tensor(value):
            key = json.dumps([name, *path])
            start, stop = element_range(value)
            pieces.append({"index": key, "start": start, "stop": stop, "ranged": {"value": value.to_local().detach().reshape(-1)}, "whole": {}})
            return {SHARDED: key, "shape": list(value.shape)}
        if isinstance(value, dict):
            return {k: walk(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(v, (*path, i)) for i, v in enumerate(value))
        return value

    return walk(state, ()), pieces


def marker_shapes(saved: Any) -> dict[str, list[int]]:
    """Each marker split_sharded left in a saved state dict: its whole shape, by its key."""
    if isinstance(saved, dict):
        if SHARDED in saved:
            return {str(saved[SHARDED]): list(saved["shape"])}
        return {k: v for value in saved.values() for k, v in marker_shapes(value).items()}
    if isinstance(saved, list | tuple):
        return {k: v for value in saved for k, v in marker_shapes(value).items()}
    return {}


def sharded_keys(saved: Any) -> list[str]:
    """The markers split_sharded left in a saved state dict."""
    return list(marker_shapes(saved))


def join_sharded(saved: Any, templates: dict[str, Any], sources: Iterable[dict[str, Any]]) -> Any:
    """`saved` with every marker replaced by a DTensor laid out as its template (the live object's
    tensor at that place now, any world size), its rows filled from the saved pieces; where the
    template is None (not sharded now) by the whole tensor, assembled from every rank's rows."""
    from torch.distributed.tensor import DTensor

    shapes = marker_shapes(saved)
    ranges = {key: element_range(t) if t is not None else (0, math.prod(int(n) for n in shapes[key])) for key, t in templates.items()}
    filled = fill_pieces(ranges, sources)
    missing = sorted(set(ranges) - set(filled))
    if missing:
        raise ShardingError(f"no rank's file holds the rows of {missing[0]}")

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if SHARDED in value:
                key = str(value[SHARDED])
                template = templates[key]
                if template is None:
                    return filled[key]["value"].view([int(n) for n in value["shape"]])
                local = filled[key]["value"].view(template.to_local().shape).to(template.device)
                return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False, shape=template.shape, stride=template.stride())
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(v) for v in value)
        return value

    return walk(saved)


def live_at(current: Any, params: list[Any] | None, path: list[Any]) -> Any:
    """The live object's value at `path` of its state dict (None: none there); for an optimizer's
    state not created yet, its parameter (optimizer state is shaped and laid out as it)."""
    value: Any = current
    for part in path:
        value = value.get(part, value.get(str(part))) if isinstance(value, dict) else value[part] if isinstance(value, list | tuple) else None
        if value is None:
            break
    if value is None and params is not None and len(path) == 3 and path[0] == "state":
        value = params[int(path[1])]
    return value


def live_state(obj: Any) -> tuple[Any, list[Any] | None]:
    params = [p for group in obj.param_groups for p in group["params"]] if isinstance(obj, torch.optim.Optimizer) else None
    return obj.state_dict(), params


def templates_of(obj: Any, keys: list[str]) -> dict[str, Any]:
    """For each marker, the live DTensor that gives its layout now, or None where the live object
    holds a plain tensor there (a sharded checkpoint resumed without sharding)."""
    current, params = live_state(obj)
    templates = {}
    for key in keys:
        _, *path = json.loads(key)
        value = live_at(current, params, path)
        templates[key] = value if is_distributed_tensor(value) else None
    return templates


def distributed_where_live(obj: Any, saved: Any) -> Any:
    """`saved` with every plain tensor that stands where the live object holds a DTensor of its
    shape replaced by this rank's rows of it, laid out as that DTensor (a replicated checkpoint
    resumed with FSDP2)."""
    current, params = live_state(obj)
    if not any(is_distributed_tensor(v) for v in _tensors(current)) and not any(is_distributed_tensor(p) for p in params or []):
        return saved  # nothing sharded here (and torch.distributed.tensor, 1.3 CPU-s with sympy, not imported for it)
    from torch.distributed.tensor import DTensor

    def walk(value: Any, path: list[Any]) -> Any:
        if isinstance(value, torch.Tensor) and not is_distributed_tensor(value):
            live = live_at(current, params, path)
            if not is_distributed_tensor(live) or tuple(live.shape) != tuple(value.shape):
                return value
            start, stop = row_range(live)
            local = value[start:stop] if value.dim() else value
            local = local.to(live.device).contiguous()
            return DTensor.from_local(local, live.device_mesh, live.placements, run_check=False, shape=live.shape, stride=live.stride())
        if isinstance(value, dict):
            return {k: walk(v, [*path, k]) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(v, [*path, i]) for i, v in enumerate(value))
        return value

    return walk(saved, [])


def _tensors(state: Any) -> Iterator[Any]:
    if isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _tensors(value)
    else:
        yield state
