"""A task defined here, outside the toolkit's packages, trained by fit() in-process: its metric
names reach steps.jsonl and metrics.jsonl, two thread ranks agree with one, a stopped and resumed
run matches an uninterrupted one, and a task that breaks the contract gets one clear line."""

from __future__ import annotations

import dataclasses
import math

import pytest

from collectives.base import SingleProcess
from collectives.testing import ThreadWorld
from tests.support.fit_in_process import HeldOut, Regression, config, steps_of, stopped_step, train
from trainers.config import OptimConfig
from trainers.context import RunContext
from trainers.guard import DivergedError
from trainers.loop.fit import fit
from trainers.preemption import StopFlag
from trainers.reporting.metrics import read_metrics
from trainers.reporting.reporter import StepReporter
from trainers.reporting.sinks import TensorBoardSink
from trainers.task import TaskError


def test_a_user_task_trains_and_its_metric_names_are_reported(tmp_path):
    result = train(tmp_path, Regression(), config())
    steps = steps_of(tmp_path)
    assert len(steps) == 2 * 512 // 16 and all("close" in s and "accuracy" not in s for s in steps)
    assert steps[-1]["loss"] < 0.25 * steps[0]["loss"]  # it learns y = 3x - 1
    epochs = read_metrics(tmp_path / "metrics.jsonl")
    assert [set(e) >= {"val_loss", "val_close"} for e in epochs] == [True, True]
    assert result.val_metrics["close"] == epochs[-1]["val_close"] and result.val_metrics["loss"] == epochs[-1]["val_loss"] < steps[0]["loss"]
    from prometheus_client.parser import text_string_to_metric_families

    exported = {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families((tmp_path / "metrics.prom").read_text())
        for s in f.samples
        if s.name == "hpctk_metric"
    }
    assert exported[(("name", "close"), ("run", ""))] == steps[-1]["close"]


def test_two_thread_ranks_agree_with_one_rank_at_the_same_global_batch(tmp_path):
    one = train(tmp_path / "one", Regression(), config(max_steps=20, batch_size=32))
    world = ThreadWorld(2)
    two = world.run(lambda comm: train(tmp_path / "two", Regression(), config(max_steps=20, batch_size=16), comm))
    assert [s["loss"] for s in steps_of(tmp_path / "two")] == pytest.approx([s["loss"] for s in steps_of(tmp_path / "one")], rel=1e-5)
    assert two[0].val_metrics == pytest.approx(one.val_metrics, rel=1e-5)


def test_a_stopped_user_task_resumes_to_the_same_steps(tmp_path):
    whole = train(tmp_path / "whole", Regression(), config(every_steps=5))
    stopped = train(tmp_path / "cut", Regression(), config(every_steps=5), stop_at=12)
    assert stopped.stopped_by == "SIGUSR1"
    resumed = train(tmp_path / "cut", Regression(), config(every_steps=5))
    assert resumed.resumed_from == stopped.steps == stopped_step(12)
    assert [s["loss"] for s in steps_of(tmp_path / "cut")] == [s["loss"] for s in steps_of(tmp_path / "whole")]
    assert resumed.val_metrics == whole.val_metrics


def test_the_held_out_split_is_evaluated_once_by_the_run_that_completes_training(tmp_path):
    stopped = train(tmp_path, HeldOut(), config(every_steps=5), stop_at=12)
    assert stopped.stopped_by == "SIGUSR1" and stopped.test_metrics == {}  # training is not complete: no test figures
    resumed = train(tmp_path, HeldOut(), config(every_steps=5))
    assert set(resumed.test_metrics) == {"loss", "close"} and resumed.val_metrics["loss"] < 1
    assert resumed.test_metrics["loss"] == pytest.approx(100, rel=0.1)  # the held-out split's figures, not validation's
    tested = [moment for moment in read_metrics(tmp_path / "metrics.jsonl") if any(key.startswith("test_") for key in moment)]
    assert tested == [read_metrics(tmp_path / "metrics.jsonl")[-1]]  # never during training: the last moment, once
    assert {key: value for key, value in tested[0].items() if key.startswith("test_")} == {f"test_{k}": v for k, v in resumed.test_metrics.items()}
    plain = train(tmp_path / "plain", Regression(), config())
    assert plain.test_metrics == {} and plain.val_metrics


def test_a_loss_that_is_not_a_scalar_is_refused_in_one_line(tmp_path):
    with pytest.raises(TaskError, match=r"the training step returned a tensor of shape \(4,\) as its loss; return the batch's mean loss as a scalar"):
        train(tmp_path, Regression(loss_shape=(4,)), config(max_steps=2))


def test_data_sets_of_different_lengths_on_the_ranks_are_refused(tmp_path):
    world = ThreadWorld(2)
    with pytest.raises(TaskError, match=r"ranks see data sets of different lengths \(train 500..512"):
        world.run(lambda comm: train(tmp_path, Regression(train_size=512 if comm.rank == 0 else 500), config(max_steps=2), comm))


def test_the_language_model_task_learns_and_reports_perplexity(tmp_path):
    from trainers.data.tokens import embedded_corpus, write_token_file
    from trainers.tasks.lm import LanguageModelTask

    write_token_file(embedded_corpus()[:60000], tmp_path / "tokens.h5")
    task = LanguageModelTask(tokens=str(tmp_path / "tokens.h5"), context=16, layers=1, heads=2, width=32)
    cfg = dataclasses.replace(config(max_steps=40, batch_size=16), optim=OptimConfig(name="adamw", lr=3e-3))
    result = train(tmp_path, task, cfg)
    steps = steps_of(tmp_path)
    assert steps[0]["loss"] > 5.0 and steps[-1]["loss"] < 0.7 * steps[0]["loss"] and "token_accuracy" in steps[-1]
    assert result.val_metrics["perplexity"] == pytest.approx(math.exp(result.val_metrics["loss"]))
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["val_perplexity"] == result.val_metrics["perplexity"]


def test_a_checkpoint_that_diverges_again_ends_the_run_instead_of_rolling_back_forever(tmp_path):
    # lr 1e30: the first update makes the weights huge; every later step overflows, and so does
    # every step after rolling back to a checkpoint saved after that first update (step 2: with
    # none yet, the run ends sooner, the test above)
    cfg = dataclasses.replace(config(every_steps=2), optim=OptimConfig(lr=1e30, momentum=0.0))
    with pytest.raises(DivergedError, match=r"training diverged: the steps after checkpoint step \d+ keep going non-finite, also after 1 rollback to it;"):
        train(tmp_path, Regression(), cfg)
    steps = steps_of(tmp_path)
    assert len(steps) < 64 and sum(1 for s in steps if s.get("skipped")) >= 6  # it stopped early, after two rollbacks


def test_a_run_that_diverges_before_any_checkpoint_fails_instead_of_completing_untrained(tmp_path):
    # lr 1e30 and no checkpoint yet: the bad ranges were skipped until the epochs ran empty and
    # the run said "completed" with not one finite step after the first
    cfg = dataclasses.replace(config(), optim=OptimConfig(lr=1e30, momentum=0.0))
    with pytest.raises(DivergedError, match=r"training diverged: 6 steps in a row went non-finite before any checkpoint, on different data;"):
        train(tmp_path, Regression(), cfg)
    steps = steps_of(tmp_path)
    assert len(steps) < 12 and sum(1 for s in steps if s.get("skipped")) >= 6


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_user_task_trains_under_reduced_precision(tmp_path, precision):
    cfg = config()
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, precision=precision))
    result = train(tmp_path, Regression(), cfg)
    steps = steps_of(tmp_path)
    assert all(math.isfinite(s["loss"]) for s in steps) and steps[-1]["loss"] < 0.25 * steps[0]["loss"]
    assert math.isfinite(result.val_metrics["loss"]) and "close" in result.val_metrics


def test_a_user_tasks_metric_names_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = StepReporter(tmp_path / "steps.jsonl", sinks=[TensorBoardSink(tmp_path / "tb")])
    run = RunContext(checkpoint_dir=tmp_path / "checkpoints", stop=StopFlag(), steps=steps)
    fit(config(), SingleProcess(), Regression(), run)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/close", "val/loss", "val/close"} <= tags and not any("accuracy" in tag for tag in tags)
    assert [e.value for e in events.Scalars("train/close")] == pytest.approx([s["close"] for s in steps_of(tmp_path)])
    assert [e.step for e in events.Scalars("val/close")] == [32, 64]  # one per epoch
