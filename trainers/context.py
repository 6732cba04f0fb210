"""What a training run is given and what it returns: the sub-configs, where its state lives across
restarts and how it learns it must stop (RunContext), and the figures it ends with (FitResult)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectives.config import CommConfig
from trainers.config import CheckpointConfig, DataConfig, ModelConfig, OptimConfig, TrainerConfig
from trainers.preemption import StopFlag
from trainers.reporting.reporter import StepReporter
from trainers.watchdog import Watchdog


@dataclass(frozen=True)
class FitConfig:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    trainer: TrainerConfig
    comm: CommConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass(frozen=True)
class FitResult:
    epochs: int  # completed: every step of each done
    steps: int
    loss: float
    samples_per_s: float
    train_seconds: float
    step_ms: float
    comm_wait_ms: float  # per step: time step() waited for gradient communication
    stopped_by: str | None = None  # the signal that stopped training early, if any
    resumed_from: int | None = None  # the checkpoint step this process started from
    val_metrics: dict[str, float] = field(default_factory=dict)  # the last validation: "loss" and the task's metrics
    test_metrics: dict[str, float] = field(default_factory=dict)  # the held-out test split's, once training completed ({}: none)
    epoch: int = 0  # the epoch the last step trained in, as the log numbers it (epoch 1/1: 1, also when max_steps ended it midway)
    bad_steps: int = 0  # steps whose gradients were not finite, skipped (over the whole run, resumes included)
    rollbacks: int = 0  # rollbacks to a checkpoint after repeated bad steps
    test_step: int | None = None  # the step whose weights test_metrics are of (checkpoint.best's, or the last)
    trackers: dict[str, str] = field(default_factory=dict)  # each tracker's state at the end: "complete", or why not


class Milestones:
    """When this start of the ranks had model, data and checkpoint ready, how long reading the
    checkpoint took, and its first step: handed once, after that step, to `on_first_step`
    (hpc.rank.main measures what an interruption cost with it). Times: Unix seconds."""

    def __init__(self, on_first_step: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._on_first_step = on_first_step
        self._times: dict[str, Any] = {}

    def loaded(self, began: float, ended: float) -> None:
        self._times.update(loaded=ended, load_s=ended - began)

    def stepped(self, step: int, resumed_from: int | None) -> None:
        if self._on_first_step is None or "first_step" in self._times:
            return
        self._times.update(first_step=time.time(), first_step_no=step, resumed_from=resumed_from)
        self._on_first_step(dict(self._times))


@dataclass
class RunContext:
    """Where a run keeps its state across restarts, and how it learns it must stop."""

    checkpoint_dir: Path | None = None
    config_text: str = ""  # the run's resolved config, stored in every checkpoint
    stop: StopFlag = field(default_factory=StopFlag)
    steps: StepReporter = field(default_factory=lambda: StepReporter(None))
    host: str = field(default_factory=socket.gethostname)  # named in straggler reports
    watchdog: Watchdog | None = None  # told of every finished step
    milestones: Milestones = field(default_factory=Milestones)
