"""What a bit-exact continuation needs, as plain tensors and numbers (no pickled objects)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from trainers.checkpoint.checkpointer import CheckpointError


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

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """In place: the loop and its registry hold this one object."""
        for name, value in Progress(**state).__dict__.items():
            setattr(self, name, value)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.position, self.epoch_loss_sum, self.epoch_seen, self.epoch_steps, self.epoch_seconds = 0, 0.0, 0, 0, 0.0


class LossScale:
    """The fp16 grad scaler as registered state: an fp32 checkpoint resumed in fp16 starts the
    scale afresh, and a saved scale is not loaded into a scaler not in use (GradScaler itself
    refuses the first)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scaler.state_dict()) if self.scaler is not None and self.scaler.is_enabled() else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)  # the fp16 loss scale continues where it was


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
