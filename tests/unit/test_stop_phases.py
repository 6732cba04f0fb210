"""A stop at any phase of a run, in-process: during start-up or resume the ranks stop before the
first step and save nothing (the newest checkpoint stays the newest); during evaluation, at the
next step boundary; the flag names the phase the signal hit. Resuming then ends bit-identical."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from torch import nn

from collectives.testing import ThreadWorld
from tests.support.fit_in_process import Regression, config, steps_of, stopped_step, train
from trainers.checkpoint.layout import committed_steps
from trainers.preemption import StopFlag
from trainers.task import StepOutput


def raised(phase: str = "start-up") -> StopFlag:
    flag = StopFlag()
    flag.note("SIGUSR1", time.time(), phase)
    return flag


def test_a_stop_during_start_up_ends_before_the_first_step_with_nothing_saved(tmp_path):
    result = train(tmp_path, Regression(), config(every_steps=5), stop=raised())
    assert (result.stopped_by, result.steps, result.resumed_from) == ("SIGUSR1", 0, None)
    assert not (tmp_path / "steps.jsonl").exists() and committed_steps(tmp_path / "checkpoints") == []


def test_a_stop_during_resume_keeps_the_checkpoint_it_loaded_as_the_newest_and_the_run_stays_exact(tmp_path):
    whole = train(tmp_path / "whole", Regression(), config(every_steps=5))
    train(tmp_path / "cut", Regression(), config(every_steps=5), stop_at=12)
    stopped = stopped_step(12)
    assert committed_steps(tmp_path / "cut" / "checkpoints")[-1] == stopped
    again = train(tmp_path / "cut", Regression(), config(every_steps=5), stop=raised("resume"))
    assert (again.stopped_by, again.resumed_from, again.steps) == ("SIGUSR1", stopped, stopped)
    assert committed_steps(tmp_path / "cut" / "checkpoints")[-1] == stopped  # nothing new was written
    finished = train(tmp_path / "cut", Regression(), config(every_steps=5))
    assert finished.resumed_from == stopped and finished.stopped_by is None
    assert [s["loss"] for s in steps_of(tmp_path / "cut")] == [s["loss"] for s in steps_of(tmp_path / "whole")]
    assert finished.val_metrics == whole.val_metrics


def test_a_run_resumed_from_its_final_checkpoint_reports_the_model_s_validation_metrics(tmp_path):
    """The ranks ended after the final save and before reporting (a rank killed then): started again,
    nothing is left to train, and the result still has the test metrics of the finished model."""
    whole = train(tmp_path, Regression(), config(every_steps=5))
    again = train(tmp_path, Regression(), config(every_steps=5))
    assert again.resumed_from == whole.steps == again.steps and again.stopped_by is None
    assert again.val_metrics == whole.val_metrics and again.val_metrics


def test_one_rank_stopped_during_start_up_stops_every_rank_before_the_first_step(tmp_path):
    world = ThreadWorld(2)
    results = world.run(lambda comm: train(tmp_path, Regression(), config(every_steps=5), comm, stop=raised() if comm.rank == 1 else None))
    assert [(r.stopped_by, r.steps) for r in results] == [("a signal on another rank", 0), ("SIGUSR1", 0)]


class SignalledInEvaluation(Regression):
    """Sends this process SIGUSR1 from its first evaluation step, as Slurm would at that moment."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = False

    def eval_step(self, model: nn.Module, batch: Any) -> StepOutput:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().eval_step(model, batch)


def test_a_signal_during_evaluation_is_named_so_and_stops_within_two_steps(tmp_path):
    flag = StopFlag().install((signal.SIGUSR1,))
    try:
        result = train(tmp_path, SignalledInEvaluation(), config(every_steps=5), stop=flag)
    finally:
        flag.uninstall()
    assert (flag.signal_name, flag.received_in) == ("SIGUSR1", "evaluation")
    # the first step after epoch 1's evaluation carries the stop; its sums are read a step late
    assert result.stopped_by == "SIGUSR1" and result.steps == 512 // 16 + 2
    assert committed_steps(tmp_path / "checkpoints")[-1] == result.steps


def phases_of_a_run(tmp_path) -> list[str]:
    seen: list[str] = []

    class Watching(StopFlag):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "phase":
                seen.append(value)
            super().__setattr__(name, value)

    train(tmp_path, Regression(), config(max_steps=40, every_steps=5), stop=Watching())
    return seen


@pytest.mark.parametrize("phase", ["resume", "training", "evaluation", "an asynchronous save", "the final save"])
def test_the_loop_names_each_phase_it_enters(tmp_path, phase):
    assert phase in phases_of_a_run(tmp_path)


def test_training_goes_on_as_training_once_an_asynchronous_save_is_handed_off(tmp_path):
    """A signal between two saves hits training, not the save before it (its writing goes on in
    the background while the steps go on)."""
    seen = phases_of_a_run(tmp_path)
    handed_off = [i for i, phase in enumerate(seen) if phase == "an asynchronous save"]
    assert len(handed_off) >= 2 and all(seen[i + 1] == "training" for i in handed_off)


def test_a_handler_a_library_installed_over_ours_is_replaced_again():
    """As NCCL 2.12 did with SIGUSR1: after reclaim() the signal reaches the stop flag again."""
    flag = StopFlag().install((signal.SIGUSR1,))
    try:
        signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # the library's handler
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not flag.raised
        flag.reclaim()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.raised and flag.signal_name == "SIGUSR1"
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
