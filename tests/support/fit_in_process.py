"""A user's task defined outside the toolkit's packages, and fit() run on it in-process (one
rank, or thread ranks): shared by the unit tests of the task seam and its optional hooks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from collectives.base import SingleProcess
from collectives.config import CommConfig
from trainers.config import CheckpointConfig, DataConfig, ModelConfig, OptimConfig, TrainerConfig
from trainers.context import FitConfig, RunContext
from trainers.data.datasets import resolve_data_path
from trainers.loop.fit import fit
from trainers.preemption import StopFlag
from trainers.reporting.reporter import StepReporter
from trainers.reporting.sinks import PrometheusFile
from trainers.task import StepOutput, Task
from trainers.tasks import build_task


class Points:
    """y = 3x - 1 plus a little noise, a map-style data set of (x, y) pairs."""

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 1, generator=generator)
        self.y = 3 * self.x - 1 + 0.01 * torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Regression:
    """A user's task: a linear model, mean squared error, and "close" (|error| < 0.1) as its metric."""

    def __init__(self, train_size: int = 512, loss_shape: tuple[int, ...] = ()) -> None:
        self.train_size, self.loss_shape = train_size, loss_shape

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def train_data(self) -> Points:
        return Points(self.train_size, seed=1)

    def eval_data(self) -> Points:
        return Points(64, seed=2)

    def batch(self, items: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([x for x, _ in items]).to(device), torch.stack([y for _, y in items]).to(device)

    def train_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        x, y = batch
        error = model(x) - y
        loss = (error**2).mean().expand(self.loss_shape) if self.loss_shape else (error**2).mean()
        return StepOutput(loss, len(x), {"close": float((error.abs() < 0.1).sum())})

    def eval_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        return self.train_step(model, batch)

    def describe(self) -> dict[str, Any]:
        return {"name": "regression"}


class HeldOut(Regression):
    """The regression with a held-out test split whose targets are off by 10: a loss near 100 tells it apart."""

    def test_data(self) -> Points:
        points = Points(32, seed=3)
        points.y += 10
        return points


def config(max_steps: int | None = None, batch_size: int = 16, every_steps: int = 0) -> FitConfig:
    return FitConfig(
        model=ModelConfig(),
        data=DataConfig(batch_size=batch_size, eval_batch_size=16),
        optim=OptimConfig(lr=0.2, momentum=0.0),
        trainer=dataclasses.replace(TrainerConfig(), epochs=2, max_steps=max_steps, watchdog_s=None, log_every=1),
        comm=CommConfig(),
        checkpoint=CheckpointConfig(every_steps=every_steps, every_minutes=None),
    )


def builtin_task(cfg: FitConfig) -> Task:
    """The built-in classification of cfg.data's HDF5 file (the built-in digits by default)."""
    provided = {"model": cfg.model, "data": cfg.data, "trainer": cfg.trainer, "data_path": resolve_data_path(cfg.data)}
    return build_task({}, provided)


def stopped_step(stop_at: int) -> int:
    """The step a run given `stop_at` stops after. The loop reports step N when it reads N's sums,
    a step late (with step N+1 queued); the flag raised then rides on step N+2's vote, read (a
    step late again) with step N+3 queued, and every rank stops there."""
    return stop_at + 3


class StopAt(StepReporter):
    """Raises the stop flag as a signal would, once step `at` is reported."""

    def __init__(self, path: Path | None, stop: StopFlag, at: int | None) -> None:
        # the exporter's file beside steps.jsonl, as trainer.prometheus_file sets it
        super().__init__(path, sinks=[PrometheusFile(path.with_name("metrics.prom"), "", every=10)] if path is not None else ())
        self.stop, self.at = stop, at

    def report(self, record: dict[str, Any]) -> None:
        super().report(record)
        if record["step"] == self.at:
            self.stop.signal_name = "SIGUSR1"


def train(run_dir: Path, task: Any, cfg: FitConfig, comm: Any = None, stop_at: int | None = None, stop: StopFlag | None = None) -> Any:
    """fit() on `task`, its files in `run_dir`; a stop as if signalled after step `stop_at`, or
    through `stop` (a flag raised already, or one installed for real signals)."""
    main = comm is None or comm.rank == 0
    stop = stop or StopFlag()
    steps = StopAt(run_dir / "steps.jsonl" if main else None, stop, stop_at)
    run = RunContext(checkpoint_dir=run_dir / "checkpoints", stop=stop, steps=steps)
    return fit(cfg, comm or SingleProcess(), task, run)


def steps_of(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def counting_blocks(task: Any) -> tuple[Any, list[int]]:
    """`task` whose model counts the calls of the first linear layer inside each block: once per
    forward, and once more per backward when the block's activations are recomputed."""
    calls = [0]
    build = task.build_model

    def build_counting() -> nn.Module:
        model = build()
        for block in model.blocks:
            next(m for m in block.modules() if isinstance(m, nn.Linear)).register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        return model

    task.build_model = build_counting
    return task, calls
