"""Model and optimizer state across sharding modes (comm.sharding): what rank 0 saves in
shared.ckpt, what every rank saves in its own file, and loading a checkpoint of any mode and world
size into the current one.

- none: all of it in shared.ckpt, as always.
- optimizer / gradients (ZeRO, collectives/zero.py): the model in shared.ckpt; each rank's part
  of the optimizer state in its own file (`optimizer_shard`).
- full (FSDP2, collectives/fsdp.py): the buffers in shared.ckpt; each rank's rows of every
  parameter (`model_shard`) and of the optimizer state (`optimizer_shard`) in its own file.

Shards are pieces named by parameter (name, or number in the optimizer's param groups) and element
range, so any saved mode loads into any other at any world size; at the same world size and
layout a rank reads only its own file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from collectives import fsdp
from collectives.zero import ShardingError, full_state, is_sharded, pieces_of_replicated
from trainers.checkpoint.checkpointer import CheckpointError

RankFiles = Callable[[], Iterable[dict[str, Any]]]  # every rank's own file of a checkpoint, read one at a time
ShardSources = Callable[[], Iterable[dict[str, Any]]]


def fsdp_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def fsdp_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return any(fsdp.is_distributed_tensor(p) for group in optimizer.param_groups for p in group["params"])


def optimizer_is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    return is_sharded(optimizer) or fsdp_optimizer(optimizer)


def model_entry(model: nn.Module) -> dict[str, torch.Tensor]:
    """shared.ckpt's model: the whole state dict, or with FSDP the entries not sharded (buffers)."""
    return fsdp.whole_model_state(model) if fsdp_sharded(model) else model.state_dict()


def own_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a rank saves of the model and optimizer in its own file: its shards, when sharded."""
    own: dict[str, Any] = {}
    if fsdp_sharded(model):
        own["model_shard"] = fsdp.model_shard_state(model)
    if is_sharded(optimizer):
        own["optimizer_shard"] = optimizer.shard_state()  # type: ignore[attr-defined]
    elif fsdp_optimizer(optimizer):
        own["optimizer_shard"] = fsdp.optimizer_shard_state(optimizer)
    return own


def restore_model(model: nn.Module, shared: dict[str, Any], own: dict[str, Any] | None, ranks: RankFiles | None, step: int) -> None:
    """The model's state from a checkpoint saved whole or in rows (FSDP), into a whole or FSDP model."""
    saved_sharded = bool(shared.get("model_sharded"))
    try:
        if not saved_sharded and not fsdp_sharded(model):
            model.load_state_dict(shared["model"])
            return
        if saved_sharded and ranks is None:
            raise ShardingError("its parameters are sharded over the ranks' files, which were not given")

        def sources() -> Iterable[dict[str, Any]]:
            if not saved_sharded:
                return [fsdp.pieces_of_whole_model(shared["model"])]
            mine = (own or {}).get("model_shard")
            if mine is not None and fsdp_sharded(model) and pieces_match(mine, fsdp.model_ranges(model)):
                return [mine]
            assert ranks is not None
            return (rank.get("model_shard", {"pieces": []}) for rank in ranks())

        if fsdp_sharded(model):
            fsdp.load_model_shards(model, shared["model"], sources())
        else:  # rows saved by FSDP ranks, into a whole model
            shapes = {name: list(value.shape) for name, value in model.state_dict().items() if name not in shared["model"]}
            model.load_state_dict({**shared["model"], **fsdp.full_model_state(sources(), shapes)})
    except (ShardingError, RuntimeError, KeyError) as err:
        raise CheckpointError(f"checkpoint step {step} does not fit this model: {' '.join(str(err).split())[:300]}") from None


def pieces_match(shard: dict[str, Any], expected: dict[Any, tuple[int, int]]) -> bool:
    """Whether a saved shard holds exactly the ranges this rank owns now (same world and layout)."""
    return {(p["index"], int(p["start"]), int(p["stop"])) for p in shard.get("pieces", [])} == {(k, a, b) for k, (a, b) in expected.items()}


def restore_optimizer(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], was_sharded: bool, mine: dict[str, Any] | None, shards: ShardSources | None, step: int
) -> None:
    """The optimizer's state from a checkpoint of any sharding and world size: a replicated state
    into a replicated optimizer or into shards; saved shards (`mine`: this rank's, used when it
    holds exactly the pieces this rank owns now; `shards`: every rank's, read one at a time) into
    shards, or assembled into a replicated optimizer."""
    try:
        if fsdp_optimizer(optimizer):
            _restore_fsdp_optimizer(optimizer, saved, was_sharded, mine, shards)
            return
        if not was_sharded:
            optimizer.load_state_dict(saved)  # a ZeRO optimizer takes its pieces of it
            return
        sources: Iterable[dict[str, Any]]
        if mine is not None and is_sharded(optimizer) and optimizer.owns_exactly(mine):  # type: ignore[attr-defined]
            sources = [mine]
        elif shards is not None:
            sources = shards()
        else:
            raise ShardingError("its optimizer state is sharded over the ranks' files, which were not given")
        if is_sharded(optimizer):
            optimizer.load_state_dict(saved)
            optimizer.load_shard_state(sources)  # type: ignore[attr-defined]
        else:
            optimizer.load_state_dict({**saved, "state": full_state(optimizer, sources)})
    except (ShardingError, ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint step {step}: the optimizer state does not load: {err}") from None


def _restore_fsdp_optimizer(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], was_sharded: bool, mine: dict[str, Any] | None, shards: ShardSources | None
) -> None:
    optimizer.load_state_dict({**saved, "state": {}})  # the param groups' hyperparameters
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sources: Iterable[dict[str, Any]]
    if not was_sharded:
        sources = [pieces_of_replicated(saved.get("state") or {}, {i: p.numel() for i, p in enumerate(params)})]
    elif mine is not None and mine.get("layout") == "fsdp":  # own files exist only at the same world size: the same rows
        sources = [mine]
    elif shards is not None:
        sources = shards()
    else:
        raise ShardingError("its optimizer state is sharded over the ranks' files, which were not given")
    fsdp.load_optimizer_shards(optimizer, sources)
