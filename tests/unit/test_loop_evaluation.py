"""The Task seam's additions, in-process on one rank: evaluation every N steps, the checkpoint
kept for the best validation figure, the task told its place, and trainer.compile."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.support.fit_in_process import HeldOut, Regression, steps_of, stopped_step, train
from tests.support.fit_in_process import config as task_config
from trainers.checkpoint.checkpointer import load_tensor_file
from trainers.checkpoint.layout import SHARED, committed_steps, step_dir_name
from trainers.context import FitConfig
from trainers.reporting.metrics import read_metrics
from trainers.task import Place


class Placed(Regression):
    """The regression task, noting the place it is told before its model is built."""

    def __init__(self) -> None:
        super().__init__()
        self.places: list[Place] = []

    def set_place(self, place: Place) -> None:
        self.places.append(place)


def evaluating(eval_every: int, best: str | None = None, best_mode: str = "min") -> FitConfig:
    cfg = task_config(every_steps=10)
    return dataclasses.replace(
        cfg,
        trainer=dataclasses.replace(cfg.trainer, eval_every=eval_every),
        checkpoint=dataclasses.replace(cfg.checkpoint, best=best, best_mode=best_mode),
    )


def test_evaluation_every_n_steps_keeps_the_best_checkpoint_and_leaves_training_alone(tmp_path):
    # val_close (the share of points within 0.1) rises as the line is learnt: with mode "min" the best is an early
    # evaluation, whose checkpoint must outlive the newest `keep` ones.
    task = Placed()
    result = train(tmp_path / "evaluated", task, evaluating(5, best="val_close", best_mode="min"))
    plain = train(tmp_path / "plain", Regression(), evaluating(0))
    assert task.places == [Place(0, 1, task.places[0].device)] and task.places[0].is_main
    steps = result.steps
    assert steps == plain.steps == 64  # 2 epochs of 512 points in batches of 16
    assert [s["loss"] for s in steps_of(tmp_path / "evaluated")] == [s["loss"] for s in steps_of(tmp_path / "plain")]

    validated = [m for m in read_metrics(tmp_path / "evaluated" / "metrics.jsonl") if "val_close" in m]
    midway = [m["step"] for m in validated if "loss" not in m]  # the epoch ends' records carry the training loss too
    assert midway == [s for s in range(5, steps + 1, 5) if s % 32]  # every 5 steps, except where an epoch's end evaluates anyway
    assert [m["step"] for m in validated if "loss" in m] == [32, 64]
    lowest = min(validated, key=lambda m: m["val_close"])  # min() keeps the first of equals, as the strict improvement does
    assert lowest["val_close"] < validated[-1]["val_close"] and lowest["step"] < steps - 20

    checkpoints = tmp_path / "evaluated" / "checkpoints"
    best = json.loads((checkpoints / "best.json").read_text())
    assert (best["step"], best["metric"], best["mode"], best["path"]) == (lowest["step"], "val_close", "min", step_dir_name(lowest["step"]))
    assert best["value"] == pytest.approx(lowest["val_close"])
    assert committed_steps(checkpoints) == [lowest["step"], steps - 4, steps]  # the newest two (every 10 steps, and the final) and the best


def test_the_test_split_is_evaluated_once_on_the_best_checkpoints_weights_unless_told_otherwise(tmp_path):
    """checkpoint.best selects the model; the held-out split is tested on it (issue 45: it was
    tested on the final weights alone), the final checkpoint staying as it was saved."""
    cfg = evaluating(5, best="val_close", best_mode="min")  # the best is an early evaluation: its weights differ from the final
    on_best = train(tmp_path / "best", HeldOut(), cfg)
    on_final = train(tmp_path / "final", HeldOut(), dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, test_best=False)))
    best = json.loads((tmp_path / "best" / "checkpoints" / "best.json").read_text())
    assert best["step"] < on_best.steps and (on_best.test_step, on_final.test_step) == (best["step"], on_final.steps)

    def loss_by_hand(step: int) -> float:  # the test split's mean loss under that checkpoint's weights
        model = HeldOut().build_model()
        weights = load_tensor_file(tmp_path / "best" / "checkpoints" / step_dir_name(step) / SHARED)["state"]["model"]
        model.load_state_dict(weights)
        points = HeldOut().test_data()
        with torch.no_grad():
            return float(((model(points.x) - points.y) ** 2).mean())

    assert on_best.test_metrics["loss"] == pytest.approx(loss_by_hand(best["step"]), rel=1e-5)
    assert on_final.test_metrics["loss"] == pytest.approx(loss_by_hand(on_best.steps), rel=1e-5)  # the same training: its final weights
    assert on_best.test_metrics["loss"] != pytest.approx(on_final.test_metrics["loss"], rel=1e-3)
    assert on_best.val_metrics == on_final.val_metrics  # validation and the final checkpoint: the last weights' either way


def test_a_compiled_run_saves_plain_names_and_resumes_uncompiled_where_it_would_have_gone(tmp_path):
    def compiling(on: bool) -> FitConfig:
        cfg = task_config(max_steps=6)
        return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, compile=on, compile_backend="eager"))

    through = train(tmp_path / "through", Regression(), compiling(False))
    compiled = train(tmp_path / "switched", Regression(), compiling(True), stop_at=1)  # as if signalled after step 1: stops after step 4
    shared = load_tensor_file(tmp_path / "switched" / "checkpoints" / step_dir_name(compiled.steps) / SHARED)
    assert sorted(shared["state"]["model"]) == ["bias", "weight"]  # no torch.compile `_orig_mod.` prefix
    resumed = train(tmp_path / "switched", Regression(), compiling(False))
    assert compiled.stopped_by and (compiled.steps, resumed.resumed_from, resumed.steps, through.steps) == (stopped_step(1), 4, 6, 6)
    losses = [s["loss"] for s in steps_of(tmp_path / "switched")]
    assert losses == [s["loss"] for s in steps_of(tmp_path / "through")]  # the eager backend runs the same kernels: the same bits


def test_a_best_figure_the_validation_does_not_report_ends_the_run_naming_what_it_reports(tmp_path):
    from trainers.task import TaskError

    with pytest.raises(TaskError, match=r"checkpoint.best=val_accuracy: the validation reports no such figure \(it reports val_close, val_loss\)"):
        train(tmp_path, Regression(), evaluating(0, best="val_accuracy"))


def test_best_json_that_cannot_be_read_is_ignored(tmp_path: Path) -> None:
    from trainers.checkpoint.layout import read_best

    (tmp_path / "best.json").write_text("{not json")
    assert read_best(tmp_path) is None
    (tmp_path / "best.json").write_text(json.dumps({"step": "3", "value": 1.0}))
    assert read_best(tmp_path) is None


def test_every_epoch_reports_each_rank_s_peak_memory_and_status_shows_the_highest(tmp_path):
    from hpc.tools.status import peak_memory_line

    train(tmp_path, Regression(), task_config())
    epochs = [m for m in read_metrics(tmp_path / "metrics.jsonl") if "loss" in m]
    assert len(epochs) == 2 and all(len(m["peak_memory_mib"]) == 1 and m["peak_memory_mib"][0] > 50 for m in epochs)  # torch alone takes more
    assert epochs[1]["peak_memory_mib"][0] >= epochs[0]["peak_memory_mib"][0]  # a peak never falls
    assert peak_memory_line([{"step": 1}, {"peak_memory_mib": [10.0, 30.4]}, {"val_loss": 1.0}]) == "peak memory 30 MiB (rank 1)"
    assert peak_memory_line([{"peak_memory_mib": "lots"}]) == ""
