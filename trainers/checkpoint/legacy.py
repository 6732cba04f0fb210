"""The built-in loop's checkpoint layout of before the one registry (trainers.checkpoint.registry),
read as that layout: a checkpoint written by an earlier version resumes where it stopped.

That layout kept the model, optimizer, schedule, scaler and progress under fixed keys of
shared.ckpt, and in each rank's file its RNG streams, buffers and ZeRO optimizer shard. With
comm.sharding=full it kept FSDP2's rows in a form of its own; such a checkpoint is refused in
one line (its optimizer rows are numbered by parameter, which the registry cannot place).
"""

from __future__ import annotations

from typing import Any

from trainers.checkpoint.checkpointer import CheckpointError
from trainers.config import CLASSIFY_TASK

LEGACY_FORMAT = "the built-in loop's layout 1"


def from_loop_layout(step: int, shared: dict[str, Any]) -> dict[str, Any]:
    """rank 0's shared.ckpt of the old layout, in the registry's."""
    if shared.get("model_sharded"):
        raise CheckpointError(
            f"checkpoint step {step} was written with comm.sharding=full in {LEGACY_FORMAT} (before registry format 2), "
            "which this version does not resume; resume it with the version that wrote it, or use a new run dir"
        )
    state = {  # under the names the built-in loop registers now (trainers.loop.build.loop_registry)
        "model": shared["model"],
        "optimizer": shared["optimizer"],
        "schedule": shared["schedule"],
        "scaler": shared.get("scaler") or {},
        "progress": shared["progress"],
    }
    return {
        "registry": {"format": 1, "step": step, "world_size": -1, "state": sorted(state), "values": [], "per_rank": []},
        "state": state,
        "values": {},
        "sharded": ["optimizer"] if shared.get("optimizer_sharded") else [],
        "config": shared.get("config", ""),
        "model_config": {"task": CLASSIFY_TASK, **shared.get("model_config", {})},  # before tasks were named: all classification
    }


def own_from_loop_layout(own: dict[str, Any]) -> dict[str, Any]:
    """A rank's own file of the old layout, in the registry's."""
    shard = own.get("optimizer_shard")
    return {
        "rng": own["rng"],
        "state": {},
        "buffers": {"model": own["buffers"]} if "buffers" in own else {},
        "optimizer_shards": {"optimizer": shard} if shard is not None else {},
        "dtensor_pieces": {"pieces": []},
    }
