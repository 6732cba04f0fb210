"""A ZeRO optimizer's state across sharding modes and world sizes (comm.sharding=optimizer or
gradients, collectives/zero.py): each rank saves its part in its own file (the registry's
`optimizer_shards`), as pieces named by the parameter's number in the param groups and an element
range, so a checkpoint loads into ZeRO at any world size, into a replicated optimizer, or into an
FSDP2 one; at the same world size and layout a rank reads only its own file. FSDP2's DTensors
travel as the registry's `dtensor_pieces` (trainers.checkpoint.registry)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from collectives import fsdp
from collectives.zero import ShardingError, full_state, is_sharded, pieces_of_replicated
from trainers.checkpoint.checkpointer import CheckpointError

ShardSources = Callable[[], Iterable[dict[str, Any]]]


def fsdp_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return any(fsdp.is_distributed_tensor(p) for group in optimizer.param_groups for p in group["params"])


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
