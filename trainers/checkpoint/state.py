"""What a bit-exact continuation needs, as plain tensors and numbers (no pickled objects)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from trainers.checkpoint.checkpointer import CheckpointError
from trainers.checkpoint.shards import RankFiles, fsdp_sharded, model_entry, optimizer_is_sharded, restore_model, restore_optimizer


@dataclass
class Progress:
    """Where training stands: the data position is a global sample index in the epoch's order."""

    step: int = 0
    epoch: int = 1
    position: int = 0
    epoch_loss_sum: float = 0.0
    epoch_seen: int = 0
    epoch_steps: int = 0
    epoch_seconds: float = 0.0
    train_seconds: float = 0.0
    bad_steps: int = 0  # steps whose update was skipped for non-finite gradients (trainers.guard)
    rollbacks: int = 0  # returns to the last committed checkpoint after too many in a row
    skip: list[list[int]] = field(default_factory=list)  # [epoch, start, end) data never trained on again

    def next_epoch(self) -> None:
        self.epoch += 1
        self.position, self.epoch_loss_sum, self.epoch_seen, self.epoch_steps, self.epoch_seconds = 0, 0.0, 0, 0, 0.0


def rng_state() -> dict[str, Any]:
    numpy_state = cast(tuple[Any, ...], np.random.get_state())  # the legacy tuple form
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of `model` as this rank holds it, persistent or not (BatchNorm's running
    statistics differ between ranks without SyncBatchNorm; rank 0's copy in shared.ckpt is not
    this rank's). Saved in each rank's own file: a resume at the same world size gives every rank
    its own back."""
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers()}


def restore_rank_buffers(model: nn.Module, saved: dict[str, torch.Tensor] | None, step: int) -> None:
    """This rank's buffers from its own file (None: none saved, or the world size changed, when
    every rank starts from rank 0's, as the docs say)."""
    if not saved:
        return
    mine = dict(model.named_buffers())
    if set(saved) != set(mine):
        name = sorted(set(saved) ^ set(mine))[0]
        where = "this model" if name in saved else "the checkpoint"
        fix = "use a new run dir or the old model config"
        raise CheckpointError(f"checkpoint step {step} does not fit this model: buffer {name!r} is missing from {where}; {fix}")
    with torch.no_grad():
        for name, buffer in mine.items():
            if tuple(saved[name].shape) != tuple(buffer.shape):
                raise CheckpointError(
                    f"checkpoint step {step} does not fit this model: buffer {name} is {tuple(saved[name].shape)} there and {tuple(buffer.shape)} here"
                )
            buffer.copy_(saved[name])


def shared_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Any,
    progress: Progress,
    model_config: dict[str, Any],
    config_text: str = "",
    scaler: Any = None,
) -> dict[str, Any]:
    return {
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else {},
        "config": config_text,
        "model": model_entry(model),  # comm.sharding=full: the buffers; the parameters' rows are in the ranks' files
        "model_sharded": fsdp_sharded(model),
        "model_shapes": {name: list(value.shape) for name, value in model.state_dict().items()} if fsdp_sharded(model) else {},
        "optimizer": optimizer.state_dict() if not optimizer_is_sharded(optimizer) else {**optimizer.state_dict(), "state": {}},
        "optimizer_sharded": optimizer_is_sharded(optimizer),  # then the state is in the ranks' files
        "schedule": schedule.state_dict(),
        "progress": asdict(progress),
        "model_config": model_config,
    }


def check_compatible(model: nn.Module, saved: dict[str, torch.Tensor], step: int) -> None:
    """Refuse a checkpoint of another model with a message naming the first difference."""
    current = model.state_dict()
    for name in sorted(set(current) | set(saved)):
        if name not in saved or name not in current:
            where = "the checkpoint" if name not in saved else "this model"
            raise CheckpointError(
                f"checkpoint step {step} does not fit this model: {name!r} is missing from {where}; use a new run dir or the old model config"
            )
        if tuple(saved[name].shape) != tuple(current[name].shape):
            raise CheckpointError(
                f"checkpoint step {step} does not fit this model: {name} is {tuple(saved[name].shape)} there and "
                f"{tuple(current[name].shape)} here; use a new run dir or the old model config"
            )


def restore(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Any,
    step: int,
    shared: dict[str, Any],
    scaler: Any = None,
    own: dict[str, Any] | None = None,
    ranks: RankFiles | None = None,
) -> Progress:
    """The state of checkpoint `step`: `shared` (rank 0's), this rank's `own` file (None when the
    world size changed) and, for sharded state, every rank's files (`ranks`, read one at a time)."""
    if not fsdp_sharded(model) and not shared.get("model_sharded"):
        check_compatible(model, shared["model"], step)
    restore_model(model, shared, own, ranks, step)
    restore_rank_buffers(model, (own or {}).get("buffers"), step)
    own_shards = (lambda: (rank.get("optimizer_shard", {}) for rank in ranks())) if ranks is not None else None
    restore_optimizer(optimizer, shared["optimizer"], bool(shared.get("optimizer_sharded")), (own or {}).get("optimizer_shard"), own_shards, step)
    schedule.load_state_dict(shared["schedule"])
    if scaler is not None and scaler.is_enabled() and shared.get("scaler"):
        scaler.load_state_dict(shared["scaler"])  # the fp16 loss scale continues where it was
    return Progress(**shared["progress"])
