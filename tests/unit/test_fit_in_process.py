"""fit() in-process, without mpirun: on a one-rank SingleProcess (the loop's bookkeeping) and
on two thread ranks of a ThreadWorld (what the ranks share after every step)."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
import torch

from collectives.base import SingleProcess
from collectives.config import CommConfig
from collectives.testing import ThreadCollectives, ThreadWorld
from tests.support.fit_in_process import Regression, builtin_task, steps_of, train
from tests.support.fit_in_process import config as task_config
from tests.support.runs import step_losses
from trainers.config import CheckpointConfig, DataConfig, ModelConfig, OptimConfig, TrainerConfig
from trainers.context import FitConfig, RunContext
from trainers.data.sampler import eval_shard
from trainers.loop.fit import fit
from trainers.reporting.metrics import read_metrics
from trainers.reporting.reporter import StepReporter
from trainers.task import TaskError


def fit_config(max_steps: int | None, batch_size: int = 256, clip_grad_norm: float | None = None) -> FitConfig:
    return FitConfig(
        model=ModelConfig(hidden_sizes=[16]),  # no dropout: thread ranks share torch's global RNG
        data=DataConfig(batch_size=batch_size),
        optim=OptimConfig(),
        trainer=dataclasses.replace(TrainerConfig(), epochs=1, max_steps=max_steps, watchdog_s=None, clip_grad_norm=clip_grad_norm),
        comm=CommConfig(),
        checkpoint=CheckpointConfig(every_steps=0, every_minutes=None),
    )


def run_fit(run_dir: Path, max_steps: int | None):  # type: ignore[no-untyped-def]
    cfg = fit_config(max_steps)
    return fit(cfg, SingleProcess(), builtin_task(cfg), RunContext(checkpoint_dir=run_dir / "checkpoints", steps=StepReporter(run_dir / "steps.jsonl")))


def test_max_steps_in_mid_epoch_leaves_the_rest_of_the_epoch_to_a_longer_run(tmp_path):
    whole = run_fit(tmp_path / "whole", None)
    steps_per_epoch = whole.steps
    assert steps_per_epoch > 2 and (whole.epochs, whole.epoch) == (1, 1)
    cut = run_fit(tmp_path / "cut", 2)
    assert (cut.steps, cut.epochs, cut.epoch) == (2, 0, 1)  # the epoch is not over; its steps were epoch 1's, as the log says
    resumed = run_fit(tmp_path / "cut", None)
    assert resumed.resumed_from == 2
    # The longer run trains the rest of epoch 1, not a fresh epoch 2 (the data after step 2 is not skipped).
    assert (resumed.steps, resumed.epochs, resumed.epoch) == (steps_per_epoch, 1, 1)
    assert [m["epoch"] for m in read_metrics(tmp_path / "cut" / "metrics.jsonl")] == [1, 1]


def run_ranks(run_dir: Path, ranks: int, batch_size: int, max_steps: int):  # type: ignore[no-untyped-def]
    """fit() on `ranks` thread ranks sharing one run dir; rank 0 writes steps.jsonl and metrics."""
    # Tight enough to act on every step: clipping must see the gradient averaged over ranks.
    cfg = fit_config(max_steps, batch_size, clip_grad_norm=0.05)

    def rank_fit(comm: ThreadCollectives):  # type: ignore[no-untyped-def]
        main = comm.rank == 0
        run = RunContext(checkpoint_dir=run_dir / "checkpoints", steps=StepReporter(run_dir / "steps.jsonl" if main else None))
        return fit(cfg, comm, builtin_task(cfg), run)

    return ThreadWorld(ranks).run(rank_fit)


def test_two_ranks_with_half_the_batch_train_as_one_rank_with_all_of_it(tmp_path):
    steps = 4
    one = run_ranks(tmp_path / "one", 1, 256, steps)
    two = run_ranks(tmp_path / "two", 2, 128, steps)
    assert [r.steps for r in two] == [steps, steps]
    assert two[0] == dataclasses.replace(
        two[1], samples_per_s=two[0].samples_per_s, train_seconds=two[0].train_seconds, step_ms=two[0].step_ms, comm_wait_ms=two[0].comm_wait_ms
    )  # reduced figures agree on every rank
    losses_one, losses_two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert sorted(losses_two) == list(range(1, steps + 1))
    assert losses_two == pytest.approx(losses_one, abs=1e-5)
    assert two[0].val_metrics["accuracy"] == pytest.approx(one[0].val_metrics["accuracy"], abs=1e-6)
    assert len({round(loss, 3) for loss in losses_two.values()}) == steps  # training moves: the comparison is not vacuous
    # The lr each step used and the averaged gradients' norm before clipping: logged, and the same
    # whether the batch is split over ranks (the norm of the average, not of one rank's gradients).
    records_one, records_two = steps_of(tmp_path / "one"), steps_of(tmp_path / "two")
    assert [r["grad_norm"] for r in records_two] == pytest.approx([r["grad_norm"] for r in records_one], rel=1e-4)
    assert all(r["grad_norm"] > 0.05 for r in records_one)  # clipping acted: the logged norm is the one before it
    assert [r["lr"] for r in records_two] == [r["lr"] for r in records_one] and records_one[0]["lr"] == pytest.approx(0.05)


def test_the_lr_each_step_used_is_logged_through_the_warm_up_and_the_norm_only_where_something_clips(tmp_path):
    cfg = fit_config(6)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, warmup_steps=4, schedule="constant"))
    run = RunContext(checkpoint_dir=tmp_path / "checkpoints", steps=StepReporter(tmp_path / "steps.jsonl"))
    fit(cfg, SingleProcess(), builtin_task(cfg), run)
    records = steps_of(tmp_path)
    assert len(records) == 5  # the epoch's steps
    assert [r["lr"] for r in records] == pytest.approx([0.05 * min(1.0, 0.01 + 0.99 * step / 4) for step in range(5)])
    assert not any("grad_norm" in r for r in records)  # no clipping: no norm computed


@pytest.mark.parametrize("augment", [{}, {"crop": 8, "crop_padding": 1, "flip": True}], ids=["plain", "crop-flip"])
def test_worker_processes_train_exactly_as_the_prefetch_thread(tmp_path, augment):
    """The same batches in the same order: bit-identical results with data read on 2 worker
    processes or on the rank's thread, with and without augmentation on the device."""
    results = []
    for workers in (0, 2):
        cfg = fit_config(8, batch_size=256)  # 5 steps per epoch: the workers serve two passes
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, workers=workers, **augment), trainer=dataclasses.replace(cfg.trainer, epochs=2))
        run = RunContext(checkpoint_dir=tmp_path / f"w{workers}" / "checkpoints")
        results.append(fit(cfg, SingleProcess(), builtin_task(cfg), run))
    assert results[0].steps == results[1].steps == 8
    assert (results[0].loss, results[0].val_metrics["accuracy"]) == (results[1].loss, results[1].val_metrics["accuracy"])


class RankMetrics(Regression):
    """The Regression task whose metrics `extra(rank, step)` can add to on some ranks (step 0:
    evaluation)."""

    def __init__(self, rank: int, extra) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.rank, self.extra, self.steps = rank, extra, 0

    def train_step(self, model, batch):  # type: ignore[no-untyped-def]
        out = super().train_step(model, batch)
        self.steps += 1
        return dataclasses.replace(out, sums={**out.sums, **self.extra(self.rank, self.steps)})

    def eval_step(self, model, batch):  # type: ignore[no-untyped-def]
        out = super().train_step(model, batch)
        return dataclasses.replace(out, sums={**out.sums, **self.extra(self.rank, 0)})


def fit_thread_ranks(tmp_path: Path, ranks: int, extra) -> list:  # type: ignore[no-untyped-def]
    def rank_fit(comm: ThreadCollectives):  # type: ignore[no-untyped-def]
        return train(tmp_path, RankMetrics(comm.rank, extra), task_config(max_steps=6), comm=comm)  # one run dir, as real ranks share

    return ThreadWorld(ranks, timeout_s=60).run(rank_fit)  # a hang fails in 60 s instead


@pytest.mark.parametrize(
    "extra, message",
    [
        (lambda rank, step: {"aux": 1.0} if rank == 2 else {}, r"at the first step: rank 2 reports 'aux', which rank 0 does not;"),
        (lambda rank, step: {"recall_7": 1.0} if rank == 1 and step >= 4 else {}, r"at step 4: rank 1 reports 'recall_7', which rank 0 does not;"),
        (lambda rank, step: {"aux": 1.0} if rank != 1 and step >= 3 else {}, r"at step 3: rank 0 reports 'aux', which rank 1 does not;"),
        (lambda rank, step: {"per_class": 1.0} if rank == 1 and step == 0 else {}, r"at evaluation: rank 1 reports 'per_class', which rank 0 does not;"),
        (lambda rank, step: {"aux": 1.0} if step >= 5 else {}, r"the metric names changed at step 5: every rank reports 'aux', which the first step did not;"),
    ],
    ids=["first-step", "one-rank-later", "one-rank-misses-it", "evaluation", "every-rank-later"],
)
def test_metric_names_that_differ_across_ranks_end_every_rank_in_one_line_naming_key_and_rank(tmp_path, extra, message):
    started = time.monotonic()
    with pytest.raises(TaskError, match=message) as err:
        fit_thread_ranks(tmp_path, 3, extra)
    assert "\n" not in str(err.value) and time.monotonic() - started < 30  # at once, not a watchdog's or barrier's timeout


def test_metrics_every_rank_reports_are_summed_over_ranks(tmp_path):
    results = fit_thread_ranks(tmp_path, 3, lambda rank, step: {"aux": float(rank)})
    assert [r.steps for r in results] == [6, 6, 6]
    batch = task_config().data.batch_size
    assert [row["aux"] for row in steps_of(tmp_path)] == [pytest.approx((0 + 1 + 2) / (3 * batch))] * 6  # summed over ranks, per sample
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    eval_batch = task_config().data.eval_batch_size
    calls = [math.ceil(len(eval_shard(64, rank, 3)) / eval_batch) for rank in range(3)]  # eval steps per rank, each adding its rank
    assert metrics[-1]["val_aux"] == pytest.approx(sum(rank * n for rank, n in enumerate(calls)) / 64)


class MemoryFormatSpy:
    """The built-in task, noting at every training step whether the model's 4-D weights are NHWC."""

    def __init__(self, task) -> None:  # type: ignore[no-untyped-def]
        self.task = task
        self.nhwc: list[bool] = []

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.task, name)

    def train_step(self, model, batch):  # type: ignore[no-untyped-def]
        self.nhwc.append(all(p.is_contiguous(memory_format=torch.channels_last) for p in model.parameters() if p.dim() == 4))
        return self.task.train_step(model, batch)


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_cnn_trains_channels_last_when_asked_and_reports_its_step_phases(tmp_path, channels_last):
    """trainer.channels_last (README), on small images: every step's data, compute, comm and
    optimizer times in steps.jsonl; NHWC weights only when asked. (model=resnet50 needs
    torchvision, which the CPU machines lack: the device suite trains it on the GPU.)"""
    import h5py
    import numpy as np

    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "images.h5", "w") as f:
        for split, n in (("train", 16), ("val", 4)):
            f[f"{split}/x"] = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
            f[f"{split}/y"] = rng.integers(0, 10, n)
    cfg = FitConfig(
        model=ModelConfig(name="cnn"),
        data=DataConfig(path=str(tmp_path / "images.h5"), batch_size=8, eval_batch_size=4),
        optim=OptimConfig(),
        trainer=dataclasses.replace(TrainerConfig(), epochs=1, watchdog_s=None, channels_last=channels_last),
        comm=CommConfig(),
        checkpoint=CheckpointConfig(enabled=False),
    )
    spy = MemoryFormatSpy(builtin_task(cfg))
    run = RunContext(steps=StepReporter(tmp_path / "steps.jsonl"))
    result = fit(cfg, SingleProcess(), spy, run)
    assert result.steps == 2 and spy.nhwc == [channels_last] * 2 and math.isfinite(result.loss)
    steps = steps_of(tmp_path)
    assert len(steps) == 2 and all(step[key] >= 0 for step in steps for key in ("data_ms", "compute_ms", "comm_ms", "optimizer_ms"))
    assert all(step["compute_ms"] > 0 for step in steps)  # forward and backward take time
