"""Independent, reproducible random streams (trainers/rngstreams.py): per rank, and per batch of a
task's data, whichever process or thread reads it."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.fit_in_process import config, steps_of, train
from trainers import rngstreams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from mytasks.noisy import Noisy  # noqa: E402  # a user's package, outside the toolkit's


def draws() -> tuple[float, float, float]:
    return float(torch.rand(())), float(np.random.rand()), random.random()


def seed_callers(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def test_every_rank_has_its_own_stream_and_the_same_one_every_time():
    rngstreams.seed_rank(0, 0)
    rank0 = draws()
    rngstreams.seed_rank(0, 1)
    rank1 = draws()
    rngstreams.seed_rank(0, 0)
    assert draws() == rank0 and all(a != b for a, b in zip(rank0, rank1, strict=True))
    rngstreams.seed_rank(1, 0)
    assert draws() != rank0  # another trainer.seed, other streams


def test_a_batch_is_read_in_its_own_stream_and_leaves_the_callers_untouched():
    seed_callers(5)
    expected = draws()
    seed_callers(5)
    with rngstreams.isolated(rngstreams.batch_seed(0, 0, 1, np.array([3, 1, 2]))):
        inside = draws()
    assert draws() == expected
    with rngstreams.isolated(rngstreams.batch_seed(0, 0, 1, np.array([3, 1, 2]))):
        assert draws() == inside  # the same batch: the same draws
    with rngstreams.isolated(rngstreams.batch_seed(0, 1, 1, np.array([3, 1, 2]))):
        assert draws() != inside  # another rank
    with rngstreams.isolated(rngstreams.batch_seed(0, 0, 2, np.array([3, 1, 2]))):
        assert draws() != inside  # the same samples in another epoch


def noisy_steps(run_dir: Path, workers: int) -> list[dict]:
    cfg = config(max_steps=12)
    train(run_dir, Noisy(), dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, workers=workers)))
    return steps_of(run_dir)


def test_a_tasks_random_transforms_are_the_same_on_workers_or_on_the_training_thread_and_never_take_the_ranks_stream(tmp_path):
    """data.workers=0 reads on the training thread, data.workers=2 on two forked processes: the
    same draws per batch (each batch's own stream), different from batch to batch, and the
    step's own draws (the rank's stream) untouched by the reading."""
    here, forked = noisy_steps(tmp_path / "thread", 0), noisy_steps(tmp_path / "workers", 2)
    assert [s["item_noise"] for s in here] == [s["item_noise"] for s in forked]
    assert len({s["item_noise"] for s in here}) == len(here)  # no two batches drew the same
    assert [s["rank0_draw"] for s in here] == [s["rank0_draw"] for s in forked]
    rngstreams.seed_rank(config().trainer.seed, 0)
    alone = [float(torch.rand(())) for _ in here]  # the rank's stream with no data reading at all
    assert [s["rank0_draw"] for s in here] == pytest.approx(alone, rel=1e-12)


def three_draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.random()), torch.rand(1).item()


@pytest.mark.parametrize("seeder", ["seed_all", "reseed", "isolated"])
def test_each_seeding_restarts_all_three_streams_from_the_whole_seed_small_or_large(seeder):
    """The same seed draws the same in Python's, numpy's and torch's streams; seeds that differ
    (in their low bits, or only above 2^32, which numpy cannot take whole) draw differently in
    each. A loader worker (reseed) and a batch's stream (isolated) rely on it."""

    def draws(seed: int) -> tuple[float, float, float]:
        if seeder == "isolated":
            with rngstreams.isolated(seed):
                return three_draws()
        getattr(rngstreams, seeder)(seed)
        return three_draws()

    seeds = (1, 2, 2**32 + 3, 7 + 2**40, 8 + 2**40)  # 2**32 + 3: numpy refuses seeds of 2**32 and up
    first = [draws(seed) for seed in seeds]
    assert first == [draws(seed) for seed in seeds]
    for stream in range(3):
        assert len({d[stream] for d in first}) == len(seeds), (stream, first)
