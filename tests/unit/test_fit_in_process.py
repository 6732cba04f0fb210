"""fit() in-process on a one-rank FakeCollectives: the loop's bookkeeping without mpirun."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from collectives.base import FakeCollectives
from collectives.config import CommConfig
from trainers.config import CheckpointConfig, DataConfig, ModelConfig, OptimConfig, TrainerConfig
from trainers.datasets import resolve_data_path
from trainers.fit import FitConfig, RunContext, fit
from trainers.metrics import MetricsWriter, read_metrics


def fit_config(max_steps: int | None) -> FitConfig:
    return FitConfig(
        model=ModelConfig(hidden_sizes=[16]),
        data=DataConfig(batch_size=256),
        optim=OptimConfig(),
        trainer=dataclasses.replace(TrainerConfig(), epochs=1, max_steps=max_steps, watchdog_s=None),
        comm=CommConfig(),
        checkpoint=CheckpointConfig(every_steps=0, every_minutes=None),
    )


def run_fit(run_dir: Path, max_steps: int | None):  # type: ignore[no-untyped-def]
    cfg = fit_config(max_steps)
    return fit(cfg, FakeCollectives(), resolve_data_path(cfg.data), MetricsWriter(run_dir / "metrics.jsonl"),
               RunContext(checkpoint_dir=run_dir / "checkpoints"))


def test_max_steps_in_mid_epoch_leaves_the_rest_of_the_epoch_to_a_longer_run(tmp_path):
    whole = run_fit(tmp_path / "whole", None)
    steps_per_epoch = whole.steps
    assert steps_per_epoch > 2 and whole.epochs == 1
    cut = run_fit(tmp_path / "cut", 2)
    assert (cut.steps, cut.epochs) == (2, 0)  # the epoch is not over
    resumed = run_fit(tmp_path / "cut", None)
    assert resumed.resumed_from == 2
    # The longer run trains the rest of epoch 1, not a fresh epoch 2 (the data after step 2 is not skipped).
    assert (resumed.steps, resumed.epochs) == (steps_per_epoch, 1)
    assert [m["epoch"] for m in read_metrics(tmp_path / "cut" / "metrics.jsonl")] == [1, 1]
