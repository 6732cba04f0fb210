"""When a save is due: the same answer on every rank, whatever each rank's own clock says."""

from __future__ import annotations

import time

from collectives.base import SingleProcess
from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.saving import SaveCoordinator
from trainers.config import CheckpointConfig


def coordinator(tmp_path, every_steps: int, every_minutes: float | None) -> SaveCoordinator:  # type: ignore[no-untyped-def]
    cfg = CheckpointConfig(every_steps=every_steps, every_minutes=every_minutes)
    return SaveCoordinator(Checkpointer(tmp_path, 0, 1, keep=cfg.keep), SingleProcess(), cfg)


def test_a_time_vote_from_any_rank_makes_the_save_due_on_every_rank(tmp_path):
    saving = coordinator(tmp_path, every_steps=0, every_minutes=60.0)
    assert saving.time_vote() == 0.0  # this rank's clock: not yet
    assert not saving.due(7, time_votes=0.0)
    assert saving.due(7, time_votes=1.0)  # another rank's clock passed the interval: save here too


def test_the_step_interval_needs_no_vote_and_a_late_clock_votes(tmp_path):
    saving = coordinator(tmp_path, every_steps=5, every_minutes=1e-6)
    assert saving.due(10, time_votes=0.0) and not saving.due(11, time_votes=0.0)
    deadline = time.monotonic() + 5
    while saving.time_vote() == 0.0:  # 60 microseconds: passes almost at once
        assert time.monotonic() < deadline
    assert saving.time_vote() == 1.0
    assert coordinator(tmp_path, every_steps=5, every_minutes=None).time_vote() == 0.0
