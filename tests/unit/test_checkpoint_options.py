"""The README's checkpoint promises, in-process: checkpoint.resume=false starts fresh in a run dir
that has checkpoints, checkpoint.enabled=false writes none, a damaged COMMITTED marker makes the
run resume from the checkpoint before it, and a checkpoint of another task is refused in one line."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from tests.support.fit_in_process import Regression, config, steps_of, train
from trainers.checkpoint.checkpointer import CheckpointError
from trainers.checkpoint.layout import MARKER
from trainers.data.tokens import embedded_corpus, write_token_file
from trainers.tasks.lm import LanguageModelTask


def with_checkpoint(max_steps: int, **changes):  # type: ignore[no-untyped-def]
    cfg = config(max_steps=max_steps, every_steps=2)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **changes))


def test_resume_false_starts_fresh_and_enabled_false_writes_nothing(tmp_path):
    first = train(tmp_path / "run", Regression(), with_checkpoint(4))
    assert (first.steps, first.resumed_from) == (4, None)
    again = train(tmp_path / "run", Regression(), with_checkpoint(6, resume=False))
    assert (again.steps, again.resumed_from) == (6, None)  # from step 1, not from the checkpoint at step 4
    assert [row["step"] for row in steps_of(tmp_path / "run")][4:] == list(range(1, 7))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000000004", "step-000000006"]  # its own, kept 2
    off = train(tmp_path / "off", Regression(), with_checkpoint(4, enabled=False))
    assert off.steps == 4 and not (tmp_path / "off" / "checkpoints").exists()


def test_a_damaged_commit_marker_is_skipped_for_the_checkpoint_before_it(tmp_path, caplog):
    train(tmp_path, Regression(), with_checkpoint(4))
    (tmp_path / "checkpoints" / "step-000000004" / MARKER).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        resumed = train(tmp_path, Regression(), with_checkpoint(6))
    assert resumed.resumed_from == 2 and resumed.steps == 6
    assert "skipping checkpoint: step-000000004: unreadable COMMITTED marker" in caplog.text


def test_a_checkpoint_of_another_task_is_refused_naming_both(tmp_path):
    train(tmp_path, Regression(), with_checkpoint(2))
    tokens = tmp_path / "tokens.h5"
    write_token_file(embedded_corpus()[:20000], tokens, 0.1)
    lm = LanguageModelTask(tokens=str(tokens), context=8, layers=1, heads=1, width=8)
    with pytest.raises(
        CheckpointError, match=r"checkpoint step 2 was written by task .*Regression, not trainers.tasks.lm.LanguageModelTask; use a new run dir"
    ):
        train(tmp_path, lm, with_checkpoint(4))
