"""The HDF5 prefetch thread: same batches in the same order, stored dtype kept, early close."""

from __future__ import annotations

import threading

import h5py
import numpy as np
import pytest
import torch

from trainers.data.reading import H5Split, Prefetcher


@pytest.fixture
def split(tmp_path):
    path = tmp_path / "images.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.integers(0, 256, size=(40, 3, 4, 4), dtype=np.uint8)
        f["y"] = np.arange(40) % 10
    opened = H5Split(path, "x", "y")
    yield opened
    opened.close()


def test_batches_arrive_in_order_as_stored_and_decode_like_read(split):
    batches = [np.array([5, 1, 9]), np.array([0, 39]), np.array([7])]
    got = list(Prefetcher(split.__getitems__, batches, depth=1))
    assert [raw.y.tolist() for raw in got] == [[5, 1, 9], [0, 9], [7]]
    assert all(raw.x.dtype == torch.uint8 for raw in got)  # uint8 travels; float is made later
    for raw, indices in zip(got, batches, strict=True):
        assert torch.equal(split.decode(raw.x), split.read(indices)[0])


def test_closing_early_stops_the_thread_and_errors_reach_the_reader(split):
    endless = (np.array([i % 40]) for i in range(10**9))
    prefetcher = Prefetcher(split.__getitems__, endless, depth=2)
    next(iter(prefetcher))
    prefetcher.close()
    assert not any(t.name == "h5-prefetch" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(IndexError, match="index 400 is outside 0..39"):
        list(Prefetcher(split.__getitems__, [np.array([400])]))
