"""Resuming with another world size: 2 ranks train until a signal stops them, 3 ranks resume
until the next signal, then 2 ranks again (wherever the signals land, epoch boundaries included). The checkpoint's rank files do
not match the new world size, so every rank starts with a fresh RNG (the saved-state-is-None
path), and the data position continues exactly: the first step after each resume trains on the
very next global batch of the epoch's order (checked by recomputing its loss from the
checkpoint's weights), and the saved positions advance by whole global batches of the new size."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from hpc.rank.lifecycle import EXIT_RESUMABLE
from tests.support.runs import logged_steps, rank_pids, resume_command, run_until_signalled, start_launch, wait_for_run
from trainers.checkpoint.checkpointer import load_tensor_file
from trainers.checkpoint.export import checkpoint_weights
from trainers.checkpoint.layout import SHARED, step_dir_name
from trainers.config import DataConfig, ModelConfig
from trainers.data.datasets import inspect_hdf5, resolve_data_path
from trainers.data.reading import H5Split
from trainers.data.sampler import ShardSampler
from trainers.models import build_model

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

# Small batches: an epoch has 89 steps on 2 ranks and 59 on 3. Under load a signal can land tens of
# steps late (seen in CI: 99 steps), so the expected positions follow epoch ends (`advance`).
BATCH, SEED = 8, 0
JOB = [
    f"data.batch_size={BATCH}",
    "model.hidden_sizes=[512,512]",
    "trainer.epochs=8",
    "trainer.watchdog_s=null",
    "checkpoint.every_steps=0",
    "checkpoint.every_minutes=null",
    "checkpoint.keep=2",
]


def progress_at(run_dir: Path, step: int) -> dict:
    return load_tensor_file(run_dir / "checkpoints" / step_dir_name(step) / SHARED)["state"]["progress"]


def num_train() -> int:
    return inspect_hdf5(resolve_data_path(DataConfig()), DataConfig()).num_train


def advance(epoch: int, position: int, steps: int, ranks: int) -> tuple[int, int]:
    """(epoch, position) after `steps` more steps on `ranks` ranks: a step starts a new epoch when
    no whole global batch is left in the current one (the sampler's rule)."""
    global_batch = ranks * BATCH
    usable = num_train() // global_batch * global_batch
    for _ in range(steps):
        if position + global_batch > usable:
            epoch, position = epoch + 1, 0
        position += global_batch
    return epoch, position


def loss_on_window(run_dir: Path, step: int, epoch: int, start: int, size: int) -> float:
    """Mean loss of checkpoint `step`'s weights on positions [start, start + size) of `epoch`'s
    order: the loss the next step must log if it trained on exactly those samples."""
    data = resolve_data_path(DataConfig())
    info = inspect_hdf5(data, DataConfig())
    model = build_model(ModelConfig(hidden_sizes=[512, 512]), info.input_shape, info.num_classes)
    directory = run_dir / "checkpoints" / step_dir_name(step)
    model.load_state_dict(checkpoint_weights(directory, load_tensor_file(directory / SHARED))[1])  # consolidated from the ranks' rows (FSDP)
    order = ShardSampler(info.num_train, BATCH, 0, 1, SEED).epoch_order(epoch)
    train = H5Split(data, "train/x", "train/y")
    try:
        x, y = train.read(order[start : start + size])
    finally:
        train.close()
    with torch.no_grad():
        return float(nn.CrossEntropyLoss()(model(x), y))


def logged_loss(run_dir: Path, step: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    (loss,) = [row["loss"] for row in rows if row["step"] == step]
    return loss


def first_stop(tmp_path: Path, sharding: list[str]) -> Path:
    """Start the run on 2 ranks through launch.py and stop it with SIGTERM after a few steps."""
    launched = start_launch(*JOB, *sharding, cwd=tmp_path)
    run_dir = wait_for_run(launched, tmp_path, lambda run: logged_steps(run) >= 3, "3 steps")
    for pid in rank_pids(run_dir):
        os.kill(pid, signal.SIGTERM)
    assert launched.wait(timeout=120) == EXIT_RESUMABLE
    return run_dir


def resume_with(run_dir: Path, ranks: int) -> tuple[int, int]:
    """Resume on `ranks` ranks, stop with SIGTERM after a few steps: (resumed from, stopped at)."""
    command, env = resume_command(run_dir)
    command[command.index("-n") + 1] = str(ranks)
    assert run_until_signalled(command, env, run_dir, 3, signal.SIGTERM) == EXIT_RESUMABLE
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == ranks and result["status"] == "stopped"
    return result["resumed_from"], result["steps"]


def check_continues(run_dir: Path, resumed: int, ranks: int, stopped: int) -> None:
    """The run resumed at checkpoint `resumed` with `ranks` ranks and stopped at `stopped`."""
    saved = progress_at(run_dir, resumed)
    epoch, position = saved["epoch"], saved["position"]
    line = f"resumed from checkpoint step {resumed} (epoch {epoch}, sample {position}); world size changed: data re-sharded by global sample index, fresh RNG"
    for rank in range(ranks):
        assert line in (run_dir / "logs" / f"rank-{rank:05d}.log").read_text(), f"rank {rank}"
    global_batch = ranks * BATCH
    next_epoch, next_end = advance(epoch, position, 1, ranks)  # the first step after the resume
    expected = loss_on_window(run_dir, resumed, next_epoch, next_end - global_batch, global_batch)
    assert logged_loss(run_dir, resumed + 1) == pytest.approx(expected, rel=1e-5)
    # The check can tell: the batch half a rank's share later gives another loss.
    assert loss_on_window(run_dir, resumed, next_epoch, next_end - global_batch + BATCH // 2, global_batch) != pytest.approx(expected, rel=1e-5)
    after = progress_at(run_dir, stopped)
    assert (after["epoch"], after["position"]) == advance(epoch, position, stopped - resumed, ranks)


# With FSDP2 on gloo (comm.sharding=full): each rank's checkpoint file holds its rows of every
# parameter and of the optimizer state, which 3 ranks read back as their own rows, and 2 ranks
# again; the data position is the same code as replicated training's (whose resharding of a
# checkpoint, with ZeRO's too, tests/unit/test_zero.py runs on thread ranks).
def test_a_run_resumes_on_more_and_on_fewer_ranks_at_the_exact_data_position(tmp_path):
    run_dir = first_stop(tmp_path, ["comm=gloo", "comm.sharding=full"])  # 2 ranks
    stopped = json.loads((run_dir / "result.json").read_text())["steps"]
    first = progress_at(run_dir, stopped)
    assert (first["epoch"], first["position"]) == advance(1, 0, stopped, ranks=2)

    resumed, stopped_again = resume_with(run_dir, ranks=3)
    assert resumed == stopped
    check_continues(run_dir, resumed=resumed, ranks=3, stopped=stopped_again)

    resumed, last = resume_with(run_dir, ranks=2)
    assert resumed == stopped_again
    check_continues(run_dir, resumed=resumed, ranks=2, stopped=last)

    steps = [json.loads(line)["step"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(1, last + 1))  # every step once: none repeated, none lost
