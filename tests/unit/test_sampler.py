import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainers.data.sampler import ShardSampler, eval_shard


def all_ranks(num_samples, batch, world, epoch, start=0, seed=0):
    return [list(ShardSampler(num_samples, batch, r, world, seed).batches(epoch, start)) for r in range(world)]


@given(num_samples=st.integers(1, 300), batch=st.integers(1, 16), world=st.integers(1, 6), epoch=st.integers(0, 5))
@settings(max_examples=200, deadline=None)
def test_ranks_read_disjoint_samples_covering_all_full_batches(num_samples, batch, world, epoch):
    if num_samples < batch * world:
        with pytest.raises(ValueError, match="global batch"):
            ShardSampler(num_samples, batch, 0, world)
        return
    per_rank = all_ranks(num_samples, batch, world, epoch)
    steps = num_samples // (batch * world)
    assert all(len(batches) == steps for batches in per_rank)
    seen = np.concatenate([np.concatenate(b) if b else np.empty(0, int) for b in per_rank])
    assert len(seen) == len(set(seen.tolist())) == steps * batch * world
    assert seen.min(initial=0) >= 0 and seen.max(initial=0) < num_samples


def test_same_seed_same_order_other_seed_or_epoch_differs():
    a = ShardSampler(100, 10, 0, 2, seed=1)
    assert np.array_equal(a.epoch_order(3), ShardSampler(100, 10, 1, 2, seed=1).epoch_order(3))
    assert not np.array_equal(a.epoch_order(3), a.epoch_order(4))
    assert not np.array_equal(a.epoch_order(3), ShardSampler(100, 10, 0, 2, seed=2).epoch_order(3))


@given(world_before=st.integers(1, 4), world_after=st.integers(1, 4), steps_done=st.integers(0, 3))
@settings(max_examples=50, deadline=None)
def test_restart_at_global_position_reads_exactly_the_rest_with_any_world_size(world_before, world_after, steps_done):
    num_samples, batch_total = 240, 24  # global batch kept: per-rank batch = 24 / world
    if batch_total % world_before or batch_total % world_after:
        return
    before = ShardSampler(num_samples, batch_total // world_before, 0, world_before)
    order = before.epoch_order(7)
    start = steps_done * batch_total
    rest = np.concatenate([np.concatenate(b) for b in all_ranks(num_samples, batch_total // world_after, world_after, 7, start)])
    assert sorted(rest.tolist()) == sorted(order[start:].tolist())


def test_start_outside_epoch_is_refused():
    with pytest.raises(ValueError, match="start position"):
        list(ShardSampler(10, 2, 0, 1).batches(0, start=11))


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_eval_shards_cover_every_sample_once(world):
    shards = np.concatenate([eval_shard(101, r, world) for r in range(world)])
    assert sorted(shards.tolist()) == list(range(101))
