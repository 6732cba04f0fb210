"""The run handle (hpc.run) in one process: what it registers, restores, saves and refuses."""

from __future__ import annotations

import json
import os
import random
import signal

import numpy as np
import pytest
import torch
from torch import nn

from hpc.rank.lifecycle import EXIT_RESUMABLE
from hpc.run import per_rank, start_run
from tests.support.ranks import one_rank  # noqa: F401  (autouse: a world of one)
from trainers.checkpoint.checkpointer import CheckpointError
from trainers.checkpoint.registry import not_plain
from trainers.task import TaskError


class Cursor:
    """A data position kept per rank."""

    def __init__(self) -> None:
        self.offset = 0

    def state_dict(self) -> dict:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.offset = state["offset"]


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def train(run, model, optimizer, scheduler, cursor: Cursor, steps: int, signal_at: int = 0) -> list[float]:  # type: ignore[no-untyped-def]
    losses = []
    while run.step < steps:
        x = torch.full((3, 4), float(cursor.offset))
        # Every stream the handle keeps is drawn from: Python's, NumPy's and torch's (issue 46: deleting
        # the Python and NumPy restores left every test passing).
        loss = model(x).square().mean() + torch.rand(()) + random.random() + float(np.random.rand())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        cursor.offset += 3
        run["seen"] = run["seen"] + 3
        losses.append(loss.item())
        if run.step + 1 == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        if run.end_step(loss=loss):
            break
    return losses


def test_a_stopped_run_saves_at_the_agreed_step_and_resumes_bit_exactly(tmp_path):
    model, optimizer, scheduler = build()
    cursor = Cursor()
    run = start_run(tmp_path / "ref", model=model, optimizer=optimizer, scheduler=scheduler, seen=0, data=per_rank(cursor))
    reference = train(run, model, optimizer, scheduler, cursor, 8)
    run.finish()
    expected = [p.detach().clone() for p in model.parameters()]

    model, optimizer, scheduler = build()
    cursor = Cursor()
    run = start_run(tmp_path / "run", model=model, optimizer=optimizer, scheduler=scheduler, seen=0, data=per_rank(cursor))
    assert run.resumed_from is None and run.step == 0
    first = train(run, model, optimizer, scheduler, cursor, 8, signal_at=3)
    assert run.stopped_by == "SIGUSR1" and run.step == 4  # the vote of step 3 is read at the next boundary
    with pytest.raises(SystemExit) as stopped:
        run.finish()  # the code after the loop runs only once training is complete
    assert stopped.value.code == EXIT_RESUMABLE
    assert signal.getsignal(signal.SIGUSR1) is not None and (tmp_path / "run" / "checkpoints" / "step-000000004" / "COMMITTED").is_file()

    model, optimizer, scheduler = build(seed=1)  # other weights: the checkpoint's must win
    cursor = Cursor()
    run = start_run(tmp_path / "run", model=model, optimizer=optimizer, scheduler=scheduler, seen=0, data=per_rank(cursor))
    assert run.resumed_from == 4 and run["seen"] == 12 and cursor.offset == 12 and scheduler.last_epoch == 4
    rest = train(run, model, optimizer, scheduler, cursor, 8)
    run.finish()
    assert first + rest == reference
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected, strict=True))
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 9)) and [s["loss"] for s in steps] == pytest.approx(reference, rel=1e-6)


def test_counts_passed_to_end_step_become_rates_and_validation_figures_the_newest(tmp_path):
    """samples= and tokens= are this rank's counts in the step: steps.jsonl gets their rate over
    the ranks (the built-in loop's names, which hpc.status reads); val_* passed to end_step() are
    the handle's newest validation figures, as run.log()'s are."""
    model, optimizer, scheduler = build()
    run = start_run(tmp_path / "run", model=model, optimizer=optimizer, scheduler=scheduler)
    for step in range(3):
        run.end_step(loss=torch.tensor(1.0), samples=8, tokens=8 * 16, **({"val_loss": 0.5 + step} if step != 1 else {}))
    run.finish()
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    for record in steps:
        seconds = record["step_ms"] / 1000
        assert record["samples_per_s"] == pytest.approx(8 / seconds) and record["tokens_per_s"] == pytest.approx(128 / seconds)
    assert run.handle.validation == {"val_loss": 2.5}


def test_a_checkpoint_of_other_state_is_refused_naming_the_difference(tmp_path):
    model, optimizer, scheduler = build()
    run = start_run(tmp_path, model=model, optimizer=optimizer, save_every_steps=1)
    assert run.end_step(loss=1.0) is False  # saved: every step
    run.finish()
    model, optimizer, scheduler = build()
    with pytest.raises(CheckpointError, match=r"checkpoint step 1 lacks state 'scheduler' that this run registers"):
        start_run(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    with pytest.raises(CheckpointError, match=r"does not fit this model: 0.weight is \(8, 4\) there and \(8, 5\) here"):
        start_run(tmp_path, model=nn.Sequential(nn.Linear(5, 8)), optimizer=optimizer)


def test_state_without_state_is_refused_in_one_line(tmp_path):
    with pytest.raises(TaskError, match=r"run state 'loader' is a builtins.function: register objects with state_dict\(\)"):
        start_run(tmp_path, loader=lambda: None)
    with pytest.raises(TaskError, match=r"run state 'best' is a numpy.float64"):
        start_run(tmp_path, best=np.float64(1.0))
    with pytest.raises(TaskError, match=r"per_rank\(\) takes objects with state_dict\(\) only"):
        start_run(tmp_path, offset=per_rank(3))
    run = start_run(tmp_path, best=1.0)
    with pytest.raises(TaskError, match=r"metric 'loss' is a tensor of shape \(2,\)"):
        run.end_step(loss=torch.zeros(2))
    with pytest.raises(KeyError, match="'worst' is not a registered plain value"):
        run["worst"] = 2.0
    run.finish()


def test_what_a_checkpoint_can_keep_without_pickling():
    assert not_plain({"a": [1, 2.0, "x", None, (torch.zeros(2),)], 3: True}, "s") is None
    assert not_plain({"a": np.zeros(2)}, "s") == "s['a'] is a numpy.ndarray"
    assert not_plain({(1, 2): 0}, "s") == "s has a key of type tuple"
