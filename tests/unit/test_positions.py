"""Data positions kept by the run handle: after a save and a resume, each reads on exactly where
the uninterrupted one would have."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpc.run import RandomWindows, ShuffledBatches, StreamCursor, per_rank, start_run
from tests.support.ranks import one_rank  # noqa: F401  (autouse: a world of one)


def take(positions, n):  # type: ignore[no-untyped-def]
    """n items of each position, as a loop takes one per step."""
    batches, windows, stream = positions
    out = []
    for _ in range(n):
        indices = next(batches["iter"], None)
        if indices is None:
            batches["iter"] = batches["obj"].epoch()
            indices = next(batches["iter"])
        x, _ = windows.get()
        out.append((indices.tolist(), x.tolist(), next(stream)))
    return out


def make():  # type: ignore[no-untyped-def]
    tokens = np.arange(1000, dtype=np.uint16) % 97
    batches = ShuffledBatches(10, batch_size=3, rank=0, world_size=1, seed=4)
    windows = RandomWindows(tokens, block_size=8, batch_size=2, seed=1, rank=0)
    return {"obj": batches, "iter": batches.epoch()}, windows, StreamCursor(lambda n: iter(range(n, 10**6)))


def test_each_position_resumes_where_it_stood_through_a_checkpoint(tmp_path):
    reference = take(make(), 9)  # three epochs of 3 batches: the epoch turns over twice

    positions = make()
    batches, windows, stream = positions
    run = start_run(tmp_path, save_every_steps=1, order=batches["obj"], windows=per_rank(windows), stream=per_rank(stream))
    first = take(positions, 4)
    for _ in first:
        run.end_step()
    run.finish()
    assert run.step == 4

    positions = make()
    batches, windows, stream = positions
    run = start_run(tmp_path, order=batches["obj"], windows=per_rank(windows), stream=per_rank(stream))
    batches["iter"] = batches["obj"].epoch()  # a resumed loop asks for the rest of the epoch
    assert run.resumed_from == 4 and batches["obj"].state_dict() == {"epoch": 2, "position": 3}
    assert first + take(positions, 5) == reference
    run.finish()


def test_ranks_split_each_global_batch_and_windows_differ_by_rank():
    ranks = [ShuffledBatches(12, batch_size=2, rank=r, world_size=3, seed=0) for r in range(3)]
    firsts = [next(r.epoch()).tolist() for r in ranks]
    assert sorted(sum(firsts, [])) == sorted(set(sum(firsts, []))) and len(sum(firsts, [])) == 6
    tokens = np.arange(500)
    a, b = (RandomWindows(tokens, 16, 4, seed=0, rank=r).get()[0] for r in (0, 1))
    assert not torch.equal(a, b) and torch.equal(a[:, 1:], a[:, :-1] + 1)  # consecutive tokens: windows of the array
    with pytest.raises(ValueError, match="8 tokens cannot fill one window of 8"):
        RandomWindows(np.arange(8), 8, 1, seed=0, rank=0)


def test_windows_are_contiguous_and_those_nanogpts_get_batch_stacks():
    """nanoGPT views its targets flat (`targets.view(-1)`), which a slice of one (batch, block + 1)
    array refuses (stride block + 1). The values are nanoGPT's windows at the drawn offsets."""
    tokens = np.arange(1000, dtype=np.uint16) % 97
    x, y = RandomWindows(tokens, block_size=64, batch_size=4, seed=3, rank=1).get()
    assert x.is_contiguous() and y.is_contiguous() and x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 64)
    assert y.view(-1).shape == (256,) and x.view(-1).shape == (256,)
    starts = np.random.default_rng([3, 1, 0]).integers(0, len(tokens) - 64, size=4)  # (seed, rank, batch 0)
    assert torch.equal(x, torch.stack([torch.from_numpy(tokens[i : i + 64].astype(np.int64)) for i in starts]))
    assert torch.equal(y, torch.stack([torch.from_numpy(tokens[i + 1 : i + 65].astype(np.int64)) for i in starts]))


def test_numbered_batches_are_the_same_whenever_they_are_asked_for():
    """A loop that draws step k+1's batch during step k (nanoGPT) gets, after a resume, the batch
    the uninterrupted run had: batch(i) depends on (seed, rank, i) alone, and draws nothing from
    torch's global generator (which dropout shares)."""
    tokens = np.arange(5000) % 251
    ahead = RandomWindows(tokens, 32, 4, seed=5, rank=1)
    drawn = [ahead.batch(i)[0] for i in (3, 0, 7, 3)]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    fresh = RandomWindows(tokens, 32, 4, seed=5, rank=1)
    assert torch.equal(fresh.batch(3)[0], drawn[0]) and torch.equal(drawn[0], drawn[3]) and torch.equal(fresh.batch(0)[0], drawn[1])
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(drawn[0], drawn[2]) and not torch.equal(RandomWindows(tokens, 32, 4, seed=5, rank=0).batch(3)[0], drawn[0])
    in_order = RandomWindows(tokens, 32, 4, seed=5, rank=1)
    assert [in_order.get()[0].tolist() for _ in range(4)] == [ahead.batch(i)[0].tolist() for i in range(4)]
    assert in_order.state_dict() == {"drawn": 4}
    with pytest.raises(ValueError, match="older toolkit"):
        in_order.load_state_dict({"generator": torch.Generator().get_state()})
    with pytest.raises(ValueError, match="batch index must be >= 0"):
        ahead.batch(-1)


def test_a_global_steps_batch_is_what_the_epochs_hand_out():
    order = ShuffledBatches(10, batch_size=2, rank=1, world_size=2, seed=3)  # 2 steps an epoch, 2 samples dropped
    handed = [indices.tolist() for _ in range(3) for indices in order.epoch()]
    assert [order.at(step).tolist() for step in range(6)] == handed and len(handed) == 6
    assert order.at(2).tolist() != order.at(0).tolist()  # each epoch its own permutation
    with pytest.raises(ValueError, match="step must be >= 0"):
        order.at(-1)
