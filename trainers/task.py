"""The seam between the toolkit and the code it trains: a `Task`.

A task supplies the model, map-style train and evaluation data sets, a training step and an
evaluation step. The toolkit keeps what makes runs safe: which samples each rank reads (the
sampler owns the exact data position, so data sets are addressed by index), gradient sync,
precision (autocast and the grad scaler wrap the step), the stop vote, checkpoints, the
watchdog, the NaN guard, and metrics averaged over ranks.

Metrics are sums over a batch's samples (`StepOutput.sums`, e.g. {"accuracy": correct
predictions}); the toolkit adds them over steps and ranks and reports each as a mean per sample
(sum / count), so every rank and every batch size weighs the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn


class TaskError(ValueError):
    """A task that breaks the seam's contract; the message names what it returned and the fix."""


@runtime_checkable
class MapDataset(Protocol):
    """Length and items by index (torch's map-style Dataset). A data set may also offer
    `__getitems__(indices) -> list of items` to read a batch at once."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


@dataclass
class StepOutput:
    """What a training or evaluation step returns for one batch."""

    loss: torch.Tensor  # a scalar: the batch's mean loss (the training step backpropagates it)
    count: int  # the samples in the batch: the weight of this batch in every mean
    sums: dict[str, float] = field(default_factory=dict)  # metric sums over the batch's samples


class Task(Protocol):
    def build_model(self) -> nn.Module:
        """The model, on the CPU; the toolkit moves it, wraps it for gradient sync, and makes
        its parameters the same on every rank."""

    def train_data(self) -> MapDataset: ...

    def eval_data(self) -> MapDataset: ...

    def batch(self, items: Any, device: torch.device) -> Any:
        """The items of one batch (a list, or what the data set's `__getitems__` returned) as
        the batch the steps take, on `device`."""

    def train_step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Forward on a batch; the toolkit runs backward on `loss` under its precision policy."""

    def eval_step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Forward without gradients; `sums` become the evaluation metrics."""

    def describe(self) -> dict[str, Any]:
        """Plain values naming the task and its model (stored in every checkpoint; a checkpoint
        written by another task is refused)."""


def read_items(dataset: MapDataset, indices: Sequence[int] | np.ndarray) -> Any:
    """The samples at `indices`: in one read where the data set offers `__getitems__`."""
    listed = [int(i) for i in indices]
    many = getattr(dataset, "__getitems__", None)  # optional, as in torch's DataLoader
    return many(listed) if many is not None else [dataset[i] for i in listed]


def to_device(value: Any, device: torch.device) -> Any:
    """Tensors inside lists, tuples and dicts moved to `device` (without waiting, from pinned memory)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(item, device) for item in value)
    return value


def pin(value: Any) -> Any:
    """Page-locked copies of the tensors in a batch, for copies to a GPU that do not wait."""
    if isinstance(value, torch.Tensor):
        return value.pin_memory()
    if isinstance(value, dict):
        return {key: pin(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(pin(item) for item in value)
    return value
