"""Global batch, LR scaling and warm-up, mixed precision state: pure parts and checkpoint content."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from torch import nn

from hpc.config.compose import compose_job
from hpc.config.validate import check_training
from hpc.errors import UserError
from tests.support.fit_in_process import Regression, config, train
from trainers.checkpoint.state import Progress
from trainers.config import OptimConfig, TrainerConfig, accumulation_steps, scaled_lr
from trainers.optim import lr_factor


def test_the_global_batch_stays_constant_when_the_rank_count_changes():
    trainer = TrainerConfig(global_batch=256)
    assert [accumulation_steps(trainer, 32, ranks) for ranks in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert accumulation_steps(TrainerConfig(accumulation_steps=3), 32, 4) == 3  # unset: as configured
    with pytest.raises(ValueError, match="not a whole multiple of 3 ranks x data.batch_size=32 = 96"):
        accumulation_steps(trainer, 32, 3)


def test_linear_lr_scaling_and_warm_up():
    assert scaled_lr(OptimConfig(lr=0.1, scale_lr=True, reference_batch=256), 1024) == pytest.approx(0.4)
    assert scaled_lr(OptimConfig(lr=0.1), 1024) == 0.1
    assert lr_factor(0, 100, 10, "constant") == pytest.approx(0.01)
    assert lr_factor(5, 100, 10, "constant") == pytest.approx(0.01 + 0.99 * 0.5)
    assert lr_factor(10, 100, 10, "constant") == 1.0
    assert lr_factor(50, 100, 0, "cosine") == pytest.approx(0.5) and lr_factor(100, 100, 0, "cosine") == pytest.approx(0.0)
    assert lr_factor(25, 100, 0, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.precision=fp8", "trainer.precision='fp8' is not one of fp32, bf16, fp16"),
        ("trainer.global_batch=100", "trainer.global_batch=100 is not a whole multiple of 2 ranks x data.batch_size=32 = 64"),
        ("trainer.clip_grad_norm=0", "trainer.clip_grad_norm=0.0 must be > 0"),
        ("optim.warmup_steps=-1", "optim.warmup_steps=-1 must be >= 0"),
        ("trainer.eval_every=-1", "trainer.eval_every=-1 must be >= 0"),
        ("checkpoint.best=loss", "checkpoint.best='loss' must name a validation figure"),
        ("checkpoint.best_mode=median", "checkpoint.best_mode='median' must be min or max"),
        ("checkpoint.best=val_loss checkpoint.enabled=false", "checkpoint.best=val_loss keeps a checkpoint, but checkpoint.enabled=false"),
    ],
)
def test_bad_training_settings_are_refused_before_launch(override, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_training(compose_job(override.split()))


def test_adjoining_skipped_ranges_are_all_skipped():
    """Successive rollbacks record adjoining ranges; the position moves past all of them (it once
    stopped inside the second and trained on it again, rolling back forever)."""
    from trainers.guard import skip_past

    progress = Progress(epoch=1, position=4224, skip=[[1, 4224, 5376], [1, 5376, 6528], [2, 0, 384]])
    assert skip_past(progress) and progress.position == 6528
    assert not skip_past(progress) and progress.position == 6528


def test_rolling_back_to_one_checkpoint_again_and_again_ends_the_run():
    """A finite step after each rollback (the checkpoint's weights are huge but finite) is no
    progress: after ROLLBACKS_PER_CHECKPOINT rollbacks to the same checkpoint, DivergedError."""
    from trainers.guard import ROLLBACKS_PER_CHECKPOINT, BadStepGuard, DivergedError

    guard = BadStepGuard(max_bad=3)
    for _ in range(ROLLBACKS_PER_CHECKPOINT):
        guard.rolled_back(10)
        guard.record(True, Progress(), 0, 0)
    with pytest.raises(DivergedError, match=rf"checkpoint step 10 keep going non-finite, also after {ROLLBACKS_PER_CHECKPOINT} rollbacks to it"):
        guard.rolled_back(10)
    fresh = BadStepGuard(max_bad=3)
    for to_step in (10, 10, 20, 20, 20, 30):  # a newer checkpoint starts the count again
        fresh.rolled_back(to_step)
        fresh.record(True, Progress(), 0, 0)


def test_bad_ranges_skipped_without_a_checkpoint_end_the_run_only_with_no_finite_step_between():
    from trainers.guard import BadStepGuard, DivergedError

    guard = BadStepGuard(max_bad=3)
    for _ in range(5):  # bad data here and there: a finite step between the ranges, training goes on
        guard.skipped_without_checkpoint()
        guard.record(True, Progress(), 0, 0)
    guard.skipped_without_checkpoint()
    with pytest.raises(DivergedError, match="training diverged: 6 steps in a row went non-finite before any checkpoint"):
        guard.skipped_without_checkpoint()


def test_deterministic_kernels_are_switched_on_before_the_first_step(tmp_path, monkeypatch):
    """trainer.deterministic turns torch's deterministic algorithms on (and cuBLAS's fixed
    workspace) before the model's first kernel; without it, the process's setting is left alone."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen: list[bool] = []

    class Watched(Regression):
        def train_step(self, model, batch):
            seen.append(torch.are_deterministic_algorithms_enabled())
            return super().train_step(model, batch)

    cfg = config(max_steps=2)
    try:
        train(tmp_path / "off", Watched(), cfg)
        off = len(seen)
        assert off > 0 and not any(seen) and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        train(tmp_path / "on", Watched(), dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, deterministic=True)))
        assert len(seen) > off and all(seen[off:]) and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.is_deterministic_algorithms_warn_only_enabled()  # an op with no such kernel warns, naming itself
    finally:
        torch.use_deterministic_algorithms(False)
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)  # absent before the test (delenv above)


def test_the_cosine_falls_to_its_floor_and_adamw_takes_its_betas():
    from trainers.optim import build_optimizer, build_schedule

    assert lr_factor(100, 100, 0, "cosine", floor=0.1) == pytest.approx(0.1) and lr_factor(0, 100, 0, "cosine", floor=0.1) == 1.0
    assert lr_factor(50, 100, 0, "cosine", floor=0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    cfg = OptimConfig(name="adamw", lr=0.01, min_lr=0.001, betas=[0.8, 0.95])
    optimizer = build_optimizer(cfg, nn.Linear(2, 2).parameters())
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    schedule = build_schedule(cfg, optimizer, total_steps=10)
    for _ in range(10):
        optimizer.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001)  # the floor, not 0


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.min_lr=0.5", r"optim.min_lr=0.5 must be between 0 and optim.lr=0.05"),
        ("optim.betas=[0.9]", r"optim.betas=\[0.9\] must be two numbers in \[0, 1\)"),
        ("optim.betas=[0.9,1.0]", r"optim.betas=\[0.9, 1.0\] must be two numbers"),
    ],
)
def test_a_floor_above_the_lr_or_bad_betas_are_refused(override, message):
    with pytest.raises(UserError, match=message):
        check_training(compose_job(override.split()))


def test_the_model_group_is_checked_for_the_built_in_task_only():
    with pytest.raises(UserError, match="model.name='gpt9' is not one of"):
        check_training(compose_job(["model.name=gpt9"]))
    check_training(compose_job(["model.name=gpt9", "task=lm"]))  # a task that builds its own model ignores the group
