"""Non-finite gradients from a poisoned sample (NaN in a float32 HDF5 data set): the step is
skipped and counted; with trainer.max_bad_steps=1 the run rolls back to its last committed
checkpoint and never trains on that data again. Training ends with finite, useful weights."""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest

from tests.support.runs import fixtures_env, run_dirs, run_launch
from trainers.config import DataConfig
from trainers.data.datasets import default_dataset_path, resolve_data_path
from trainers.data.sampler import ShardSampler

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

RANKS, BATCH, EPOCHS = 2, 32, 3


def poisoned_digits(path, at_step: int):
    """The digits as float32, one training sample NaN: the one epoch 1 reaches at `at_step`."""
    resolve_data_path(DataConfig())  # builds the digits file once
    with h5py.File(default_dataset_path(), "r") as src, h5py.File(path, "w") as dst:
        for split in (name for name in ("train", "val", "test") if name in src):  # digits files before val/ hold test/
            x = src[f"{split}/x"][...].astype(np.float32) * float(src[f"{split}/x"].attrs["scale"])
            dst[f"{split}/y"] = src[f"{split}/y"][...]
            if split == "train":
                order = ShardSampler(len(x), BATCH, 0, RANKS, seed=0).epoch_order(1)
                x[order[at_step * RANKS * BATCH + 5]] = np.nan
            dst[f"{split}/x"] = x
    return path


def steps(run_dir):
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("max_bad", [3, 1])
def test_a_poisoned_sample_is_skipped_or_rolled_back_and_training_ends_finite(tmp_path, max_bad):
    data = poisoned_digits(tmp_path / "poisoned.h5", at_step=9)
    done = run_launch(
        f"data.path={data}",
        f"trainer.epochs={EPOCHS}",
        f"trainer.max_bad_steps={max_bad}",
        "checkpoint.every_steps=4",
        "checkpoint.every_minutes=null",
        "checkpoint.async_save=false",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    records = steps(run_dir)
    skipped = [r["step"] for r in records if r.get("skipped")]
    result = json.loads((run_dir / "result.json").read_text())
    assert math.isfinite(result["loss"]) and result["val_metrics"]["accuracy"] > 0.5  # it learned (10 classes: chance is 0.1)
    log = (run_dir / "logs" / "rank-00000.log").read_text()
    assert (result["bad_steps"], result["rollbacks"]) == (records[-1]["bad_steps"], records[-1]["rollbacks"])  # result.json says so too
    if max_bad == 3:  # the sample comes once per epoch: skipped, never three in a row
        assert len(skipped) == EPOCHS and records[-1]["bad_steps"] == EPOCHS and records[-1]["rollbacks"] == 0
        assert skipped[0] == 10  # epoch 1, its 10th step
    else:  # each time: back to the last checkpoint, that step's data skipped for good
        assert len(skipped) == EPOCHS and records[-1]["rollbacks"] == EPOCHS
        assert log.count("rolled back from step") == EPOCHS
        assert "rolled back from step 11 to checkpoint step 8" in log  # step 10's sums are read a step late, with step 11 done
    assert "non-finite gradients" in log


def test_before_the_first_checkpoint_there_is_no_rollback_but_the_data_is_skipped(tmp_path):
    data = poisoned_digits(tmp_path / "poisoned.h5", at_step=2)
    done = run_launch(
        f"data.path={data}",
        "trainer.epochs=1",
        "trainer.max_bad_steps=1",
        "checkpoint.every_steps=8",
        "checkpoint.every_minutes=null",
        "checkpoint.async_save=false",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    records = steps(run_dir)
    assert [r["step"] for r in records if r.get("skipped")] == [3] and records[-1]["rollbacks"] == 0
    assert "no committed checkpoint yet: going on without a rollback" in (run_dir / "logs" / "rank-00000.log").read_text()


def test_a_user_tasks_poisoned_sample_is_rolled_back_past_and_training_ends_finite(tmp_path):
    """The same guard for a user's task (tests/fixtures/mytasks) whose data holds a NaN sample."""
    samples = 2048
    poison = int(ShardSampler(samples, BATCH, 0, RANKS, seed=0).epoch_order(1)[9 * RANKS * BATCH + 5])
    done = run_launch(
        "task._target_=mytasks.regression.Regression",
        f"+task.samples={samples}",
        f"+task.poison={poison}",
        f"trainer.epochs={EPOCHS}",
        "trainer.max_bad_steps=1",
        "optim.lr=0.2",
        "checkpoint.every_steps=4",
        "checkpoint.every_minutes=null",
        "checkpoint.async_save=false",
        cwd=tmp_path,
        env=fixtures_env(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    records = steps(run_dir)
    assert [r["step"] for r in records if r.get("skipped")][0] == 10 and records[-1]["rollbacks"] == EPOCHS
    # step 10's sums are read a step late, with step 11 done; step 10's own samples are the ones skipped
    log = (run_dir / "logs" / "rank-00000.log").read_text()
    assert "rolled back from step 11 to checkpoint step 8" in log and f"samples {9 * RANKS * BATCH}..{10 * RANKS * BATCH} of epoch 1 are skipped" in log
    result = json.loads((run_dir / "result.json").read_text())
    assert math.isfinite(result["loss"]) and result["val_metrics"]["close"] > 0.5  # it learned y = 3x - 1 (|error| < 0.1 for most)
