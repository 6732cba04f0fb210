"""The seam between the toolkit and the code it trains: a `Task`.

A task supplies the model, map-style train and validation data sets (optionally a held-out test
set), a training step and an evaluation step. The toolkit keeps what makes runs safe: which samples each rank reads (the
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


class RefusedOnEveryRank(TaskError):
    """A refusal every rank meets alike before the ranks communicate (a missing run dir): said once."""


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
    # metric sums over the batch's samples: numbers, or one-element tensors (left on the device,
    # they are read with the step's other figures, once per step)
    sums: dict[str, float | torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Place:
    """Where a task runs, told before build_model (Task.set_place): tasks need not read launcher
    variables to sample text on one rank or name a file per rank."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class Task(Protocol):
    def set_place(self, place: Place) -> None:
        """Optional: this rank's place (rank, world size, is_main, device), before build_model."""

    def build_model(self) -> nn.Module:
        """The model, on the CPU; the toolkit moves it, wraps it for gradient sync, and makes
        its parameters the same on every rank."""

    def train_data(self) -> MapDataset: ...

    def eval_data(self) -> MapDataset:
        """The validation split, evaluated after every epoch (and what a search tunes on)."""

    def test_data(self) -> MapDataset | None:
        """Optional: a held-out test split, evaluated once, at the end of a run that completed
        (result.json's test_metrics). None or absent: no test split."""

    def batch(self, items: Any, device: torch.device) -> Any:
        """The items of one batch (a list, or what the data set's `__getitems__` returned) as
        the batch the steps take, on `device`."""

    def train_step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Forward on a batch; the toolkit runs backward on `loss` under its precision policy.
        Parameters must not change here (only the optimizer step changes them): an asynchronous
        checkpoint copies them while this step runs."""

    def eval_step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Forward without gradients; `sums` become the evaluation metrics."""

    def describe(self) -> dict[str, Any]:
        """Plain values naming the task and its model (stored in every checkpoint; a checkpoint
        written by another task is refused)."""

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        """Optional: the evaluation's means per sample ("loss" and the metrics) with figures
        derived from them added, e.g. perplexity = exp(loss)."""

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """Optional: the optimizer's parameter groups, as torch takes them ({"params": [...],
        "weight_decay": 0.0}, ...); every trainable parameter in exactly one group. Default: one
        group of all parameters, with the optim config's settings."""

    def checkpointed_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """Optional: the modules whose activations are recomputed in backward instead of kept,
        with trainer.activation_checkpointing=true (a transformer's blocks, typically). Their
        forward must not update buffers (BatchNorm's running statistics would update twice)."""


@dataclass(frozen=True)
class Collated:
    """A batch collated where it was read (a loader worker, as torch's DataLoader collates): one
    tensor per field crosses to the rank, not one per sample. Only for tasks without `batch`."""

    value: Any

    def pin_memory(self) -> Collated:  # trainers.task.pin honours it, as torch's DataLoader does
        return Collated(pin(self.value))


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
    """Page-locked copies of the tensors in a batch, for copies to a GPU that do not wait (an
    object with its own `pin_memory()`, as torch's DataLoader honours, makes its own)."""
    if isinstance(value, torch.Tensor) or callable(getattr(value, "pin_memory", None)):
        return value.pin_memory()
    if isinstance(value, dict):
        return {key: pin(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(pin(item) for item in value)
    return value


def checked_groups(groups: list[Any], model: nn.Module, where: str) -> list[dict[str, Any]]:
    """Parameter groups that hold every trainable parameter of `model` once, and nothing else."""
    names = {id(p): name for name, p in model.named_parameters()}
    seen: set[int] = set()
    for group in groups:
        if not isinstance(group, dict) or "params" not in group:
            raise TaskError(f"{where} returned a {type(group).__name__} as a group; return dicts with a 'params' list")
        group["params"] = list(group["params"])
        for parameter in group["params"]:
            if id(parameter) not in names:
                raise TaskError(f"{where}: a group holds a tensor that is not a parameter of the model")
            if id(parameter) in seen:
                raise TaskError(f"{where}: parameter {names[id(parameter)]!r} is in more than one group")
            seen.add(id(parameter))
    left_out = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if left_out:
        raise TaskError(f"{where} leaves out {len(left_out)} trainable parameters ({left_out[0]!r}, ...); put them in a group, or set requires_grad=False")
    return groups


REQUIRED = ("build_model", "train_data", "eval_data", "train_step", "eval_step")


class _Adapted:
    """A user's task with the optional parts filled in: `batch` (torch's default collate, then
    to the device) and `describe` (the class's name)."""

    def __init__(self, task: Any, target: str) -> None:
        self._task, self._target = task, target

    @property
    def tokens_per_sample(self) -> int | None:
        """Optional: the tokens one sample holds (a language model's context), for tokens/s."""
        value = getattr(self._task, "tokens_per_sample", None)
        return int(value) if isinstance(value, int) and value > 0 else None

    def set_place(self, place: Place) -> None:
        custom = getattr(self._task, "set_place", None)
        if custom is not None:
            custom(place)

    def build_model(self) -> nn.Module:
        model = self._task.build_model()
        if not isinstance(model, nn.Module):
            raise TaskError(f"{self._target}.build_model returned a {type(model).__name__}; return a torch.nn.Module")
        return model

    def train_data(self) -> MapDataset:
        return self._data(self._task.train_data(), "train_data")

    def eval_data(self) -> MapDataset:
        return self._data(self._task.eval_data(), "eval_data")

    def test_data(self) -> MapDataset | None:
        custom = getattr(self._task, "test_data", None)
        data = custom() if custom is not None else None
        return None if data is None else self._data(data, "test_data")

    def _data(self, data: Any, what: str) -> MapDataset:
        if not isinstance(data, MapDataset):
            raise TaskError(f"{self._target}.{what} returned a {type(data).__name__}; return a map-style data set (__len__ and __getitem__)")
        return data

    def collate_where_read(self) -> Any:
        """What a loader worker applies to the items it read: torch's default collate, unless
        the task collates itself (`batch` gets the items)."""
        if getattr(self._task, "batch", None) is not None:
            return None
        from torch.utils.data import default_collate

        return default_collate

    def batch(self, items: Any, device: torch.device) -> Any:
        if isinstance(items, Collated):  # by a loader worker (collate_where_read)
            return to_device(items.value, device)
        custom = getattr(self._task, "batch", None)
        if custom is not None:
            return custom(items, device)
        from torch.utils.data import default_collate

        return to_device(default_collate(items), device)

    def train_step(self, model: nn.Module, batch: Any) -> StepOutput:
        return self._output(self._task.train_step(model, batch), "train_step")

    def eval_step(self, model: nn.Module, batch: Any) -> StepOutput:
        return self._output(self._task.eval_step(model, batch), "eval_step")

    def _output(self, out: Any, what: str) -> StepOutput:
        if not isinstance(out, StepOutput):
            raise TaskError(f"{self._target}.{what} returned a {type(out).__name__}; return trainers.task.StepOutput(loss, count, sums)")
        return out

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        custom = getattr(self._task, "summarize", None)
        return dict(custom(means)) if custom is not None else means

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        custom = getattr(self._task, "param_groups", None)
        if custom is None:
            return [{"params": list(model.parameters())}]
        return checked_groups(list(custom(model)), model, f"{self._target}.param_groups")

    def checkpointed_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        custom = getattr(self._task, "checkpointed_modules", None)
        if custom is None:
            raise TaskError(f"trainer.activation_checkpointing=true: {self._target} names no modules to recompute; define checkpointed_modules(model)")
        modules = list(custom(model))
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            raise TaskError(f"{self._target}.checkpointed_modules returned no modules; return the torch.nn.Modules to recompute in backward")
        return modules

    def describe(self) -> dict[str, Any]:
        custom = getattr(self._task, "describe", None)
        described = dict(custom()) if custom is not None else {"name": self._target.rpartition(".")[2]}
        return {**described, "task": self._target}


def adapt(task: Any, target: str) -> Task:
    """`task` checked for what the seam needs and completed with the optional parts; the built-in
    tasks, which provide everything, pass through the same checks."""
    if isinstance(task, _Adapted):
        return task
    missing = [name for name in REQUIRED if not callable(getattr(task, name, None))]
    if missing:
        raise TaskError(f"{target} is not a task: it has no {', '.join(missing)} (see trainers/task.py)")
    return _Adapted(task, target)
