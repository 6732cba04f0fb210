"""Worker processes reading batches: the sampler's exact order whatever the worker count, the
shared-slot path and the pickled path (a user's data set), passes closed early, and workers
that fail, die or outlive their rank."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest
import torch

from trainers.data import reading as data_module
from trainers.data.loader import DataWorkerError, WorkerLoader
from trainers.data.reading import H5Split
from trainers.data.sampler import ShardSampler

ROWS = 300


@pytest.fixture(params=["direct", "in-memory"])
def shards(request, tmp_path, monkeypatch):
    """Three shards of one split; 'direct' reads rows with pread, 'in-memory' keeps them."""
    if request.param == "direct":
        monkeypatch.setattr(data_module, "IN_MEMORY_LIMIT_BYTES", 0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (ROWS, 3, 5, 5), dtype=np.uint8)
    y = rng.integers(0, 10, ROWS)
    paths = []
    for i, (lo, hi) in enumerate([(0, 100), (100, 220), (220, ROWS)]):
        paths.append(tmp_path / f"train-{i}.h5")
        with h5py.File(paths[-1], "w") as f:
            f["train/x"], f["train/y"] = x[lo:hi], y[lo:hi]
    split = H5Split(paths, "train/x", "train/y")
    yield split, x, y
    split.close()


def expected(x, y, sampler, epoch, start=0):
    return [(x[i], y[i]) for i in sampler.batches(epoch, start)]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_batches_arrive_in_the_samplers_order_pass_after_pass(shards, workers):
    split, x, y = shards
    sampler = ShardSampler(ROWS, 16, rank=1, world_size=2, seed=3)
    loader = WorkerLoader(split, workers, batch_size=16, prefetch=2)
    try:
        for epoch, start in ((0, 0), (1, 64), (2, 0)):  # the second pass resumes mid-epoch
            batches = loader.epoch(sampler.batches(epoch, start))
            got = [(b.x.numpy().copy(), b.y.numpy().copy(), b.scale) for b in batches]
            batches.close()
            want = expected(x, y, sampler, epoch, start)
            assert len(got) == len(want) > 0
            for (gx, gy, scale), (wx, wy) in zip(got, want, strict=True):
                assert np.array_equal(gx, wx) and np.array_equal(gy, wy) and scale == pytest.approx(1 / 255)
    finally:
        loader.close()


def test_a_batch_stays_valid_while_the_next_is_used(shards):
    """Slots are reused, but never under a batch the rank may still hold: the one before the
    batch in use, whichever order the workers finish in."""
    split, x, _ = shards
    sampler = ShardSampler(ROWS, 8, 0, 1, seed=0)
    loader = WorkerLoader(split, 3, batch_size=8, prefetch=4)
    try:
        order = list(sampler.batches(0))
        batches = iter(loader.epoch(iter(order)))
        previous = next(batches)
        for before, indices in zip(order[:-1], order[1:], strict=True):
            current = next(batches)
            assert np.array_equal(current.x.numpy(), x[indices])
            assert np.array_equal(previous.x.numpy(), x[before])  # not refilled while `current` is used
            previous = current
    finally:
        loader.close()


def test_a_pass_closed_early_leaves_the_next_pass_exact(shards):
    split, x, y = shards
    sampler = ShardSampler(ROWS, 10, 0, 1, seed=1)
    loader = WorkerLoader(split, 2, batch_size=10, prefetch=3)
    try:
        cut = loader.epoch(sampler.batches(0))
        next(iter(cut))  # the stop vote ends the pass with batches still being read
        cut.close()
        again = loader.epoch(sampler.batches(0, start=10))
        assert [b.y.tolist() for b in again] == [y[i].tolist() for i in sampler.batches(0, start=10)]
        again.close()
    finally:
        loader.close()
    assert all(not p.is_alive() for p in loader._processes)


class Pairs:
    """A user's data set: items are (tensor, dict) pairs, read one at a time."""

    def __init__(self, n: int) -> None:
        self.values = torch.arange(n, dtype=torch.float32) * 0.5

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, int]]:
        if index == 13:
            raise KeyError("sample 13 is missing")
        return self.values[index : index + 1].clone(), {"index": index, "pid": os.getpid()}


def test_a_users_data_set_is_read_on_the_workers_in_order():
    sampler = ShardSampler(12, 4, 0, 1, seed=2)
    loader = WorkerLoader(Pairs(12), 2, batch_size=4)
    try:
        items = list(loader.epoch(sampler.batches(0)))
    finally:
        loader.close()
    assert [[meta["index"] for _, meta in batch] for batch in items] == [b.tolist() for b in sampler.batches(0)]
    assert all(float(t) == 0.5 * meta["index"] for batch in items for t, meta in batch)
    assert os.getpid() not in {meta["pid"] for batch in items for _, meta in batch}  # read elsewhere


def test_a_users_items_are_collated_in_the_worker_one_tensor_per_field():
    """As torch's DataLoader does: a batch crosses as one tensor per field, not one per sample
    (each costs a shared-memory handle: sent one by one, 0.07x DataLoader's rate,
    benchmarks/task_loader.py). A task with its own `batch` gets the items themselves."""
    from torch.utils.data import default_collate

    from trainers.task import Collated, adapt

    sampler = ShardSampler(12, 4, 0, 1, seed=2)
    loader = WorkerLoader(Pairs(12), 2, batch_size=4, collate=default_collate)
    try:
        batches = list(loader.epoch(sampler.batches(0)))
    finally:
        loader.close()
    assert all(isinstance(b, Collated) for b in batches)
    for batch, indices in zip(batches, sampler.batches(0), strict=True):
        values, meta = batch.value
        assert values.shape == (4, 1) and values.flatten().tolist() == [0.5 * i for i in indices] and meta["index"].tolist() == indices.tolist()

    class Plain:  # the five methods a task must have; no batch()
        build_model = train_data = eval_data = train_step = eval_step = staticmethod(lambda *args: None)

    class OwnBatch(Plain):
        def batch(self, items, device):  # type: ignore[no-untyped-def]
            return items

    assert adapt(Plain(), "t.Plain").collate_where_read() is default_collate and adapt(OwnBatch(), "t.OwnBatch").collate_where_read() is None
    cpu = torch.device("cpu")
    assert adapt(Plain(), "t.Plain").batch(batches[0], cpu)[0] is batches[0].value[0]  # collated once, in the worker


def test_an_error_in_a_worker_reaches_the_rank_with_its_batch():
    loader = WorkerLoader(Pairs(16), 2, batch_size=4)
    try:
        with pytest.raises(DataWorkerError, match=r"batch 3: KeyError: 'sample 13 is missing'"):
            list(loader.epoch(iter([np.arange(0, 4), np.arange(4, 8), np.arange(8, 12), np.arange(12, 16)])))
    finally:
        loader.close()


def test_a_killed_worker_is_named_instead_of_a_hang(shards):
    split, _, _ = shards
    loader = WorkerLoader(split, 2, batch_size=4)
    try:
        os.kill(loader._processes[1].pid, signal.SIGKILL)
        loader._processes[1].join(timeout=10)
        with pytest.raises(DataWorkerError, match="data worker 1 died \\(killed by SIGKILL, often the out-of-memory killer"):
            list(loader.epoch(iter([np.arange(4)] * 6)))
    finally:
        loader.close()


def test_workers_leave_stop_signals_to_their_rank():
    """Slurm signals every process of a step; the rank decides when to stop, its workers read on."""
    sampler = ShardSampler(12, 4, 0, 1, seed=2)
    loader = WorkerLoader(Pairs(12), 2, batch_size=4)
    try:
        for pid in (p.pid for p in loader._processes):
            for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                os.kill(pid, stop)
        for epoch in range(2):
            assert len(list(loader.epoch(sampler.batches(epoch)))) == 3
        assert all(p.is_alive() for p in loader._processes)
    finally:
        loader.close()


def test_workers_end_with_their_rank(tmp_path):
    """A rank killed outright (the watchdog, the OOM killer) takes its workers with it."""
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from tests.unit.test_loader import Pairs
            from trainers.data.loader import WorkerLoader
            loader = WorkerLoader(Pairs(8), 2, batch_size=2)
            print(" ".join(str(p.pid) for p in loader._processes), flush=True)
            time.sleep(600)
            """
        )
    )
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        pids = [int(p) for p in rank.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        rank.kill()
        rank.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids)
    finally:
        rank.kill()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_loader_needs_a_worker(shards):
    with pytest.raises(ValueError, match="workers >= 1"):
        WorkerLoader(shards[0], 0, batch_size=4)


def test_batches_for_a_gpu_are_copied_on_a_thread_in_order(shards):
    """With a GPU the batches are made page-locked on a thread (here: a copy that marks them)."""
    split, x, y = shards
    sampler = ShardSampler(ROWS, 12, 0, 1, seed=4)
    loader = WorkerLoader(split, 2, batch_size=12)
    copied = []

    def pin(batch):
        copied.append(batch.x.data_ptr())
        return type(batch)(batch.x.clone(), batch.y.clone(), batch.scale)

    try:
        batches = loader.epoch(sampler.batches(0), pin=pin)
        got = [(b.x, b.y) for b in batches]
        batches.close()
        assert len(copied) == len(got) == sampler.steps_per_epoch
        assert all(np.array_equal(gx.numpy(), x[i]) and gy.tolist() == y[i].tolist() for (gx, gy), i in zip(got, sampler.batches(0), strict=True))
        cut = loader.epoch(sampler.batches(1), pin=pin)
        next(iter(cut))
        cut.close()  # the copying thread stops, then the workers are drained
        assert [b.y.tolist() for b in loader.epoch(sampler.batches(2))] == [y[i].tolist() for i in sampler.batches(2)]
    finally:
        loader.close()


class Exits:
    """A data set whose item 9 ends its process (a crash in native code, an os._exit)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        if index == 9:
            os._exit(3)
        return index


def test_a_worker_dying_mid_pass_is_named_and_the_loader_refuses_more():
    loader = WorkerLoader(Exits(), 2, batch_size=4)
    try:
        batches = loader.epoch(iter([np.arange(0, 4), np.arange(4, 8), np.arange(8, 12), np.arange(12, 16)]))
        with pytest.raises(DataWorkerError, match=r"^data worker 0 died \(exit code 3\)$"):
            list(batches)
        batches.close()  # collects what it can, raises nothing more
        with pytest.raises(DataWorkerError, match="data worker 0 died"):
            loader.epoch(iter([np.arange(4)]))
    finally:
        loader.close()


class Unsendable:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> object:
        return lambda: index  # cannot be pickled back to the rank


def test_items_that_cannot_be_sent_back_are_named():
    loader = WorkerLoader(Unsendable(), 1, batch_size=4)
    try:
        with pytest.raises(DataWorkerError, match=r"data worker 0, batch 0: .*(Pickl|pickle)"):
            list(loader.epoch(iter([np.arange(4)])))
    finally:
        loader.close()


def test_a_shard_gone_after_the_start_is_named_by_the_read(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "IN_MEMORY_LIMIT_BYTES", 0)  # shards are opened when first read
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"train-{i}.h5")
        with h5py.File(paths[-1], "w") as f:
            f["train/x"], f["train/y"] = np.zeros((10, 3), np.uint8), np.zeros(10, int)
    split = H5Split(paths, "train/x", "train/y")
    paths[1].rename(tmp_path / "moved.h5")
    loader = WorkerLoader(split, 1, batch_size=4)
    try:
        with pytest.raises(DataWorkerError, match=r"batch 0: FileNotFoundError: .*train-1.h5"):
            list(loader.epoch(iter([np.array([15, 3])])))
    finally:
        loader.close()


def test_batches_larger_than_a_pipe_holds_never_block(tmp_path):
    """Indices and labels travel in shared memory: 60,000 per batch (480 kB each way) pass."""
    path = tmp_path / "many.h5"
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = np.arange(120_000, dtype=np.int32)[:, None], np.arange(120_000) % 7
    split = H5Split(path, "x", "y")
    sampler = ShardSampler(120_000, 60_000, 0, 1, seed=0)
    loader = WorkerLoader(split, 1, batch_size=60_000)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the loader blocked"))
    signal.alarm(60)
    try:
        got = [b.x[:, 0].tolist() for b in loader.epoch(sampler.batches(0))]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        loader.close()
    assert got == [b.tolist() for b in sampler.batches(0)]


def test_a_pass_ended_by_failed_batches_leaves_every_slot_to_the_next(shards):
    """Failed batches and a pass closed with reads in flight never leave a slot counted twice:
    the next passes read exact batches."""
    split, x, y = shards
    sampler = ShardSampler(ROWS, 10, 0, 1, seed=5)
    loader = WorkerLoader(split, 2, batch_size=10, prefetch=3)
    try:
        for _ in range(3):
            broken = [np.arange(10), np.full(10, ROWS + 1), np.arange(10, 20), np.full(10, -1), np.arange(20, 30)]
            with pytest.raises(DataWorkerError, match=r"batch 1: IndexError: sample index 301 is outside 0..299"):
                list(loader.epoch(iter(broken)))
        for epoch in range(2):
            batches = loader.epoch(sampler.batches(epoch))
            for batch, indices in zip(batches, sampler.batches(epoch), strict=True):
                assert np.array_equal(batch.x.numpy(), x[indices]) and batch.y.tolist() == y[indices].tolist()
            assert sorted(loader.free) != [] and len(set(loader.free)) == len(loader.free)
    finally:
        loader.close()


def test_pin_makes_a_batch_objects_own_page_locked_copy():
    """trainers.task.pin honours a batch's own pin_memory (RawBatch's), as torch's DataLoader does."""
    from trainers.task import pin

    class Marked:
        def pin_memory(self):
            return "pinned copy"

    assert pin(Marked()) == "pinned copy"
    assert pin({"batch": [Marked(), 3]}) == {"batch": ["pinned copy", 3]}


class Logged:
    """A data set that appends each index it reads to a file (the workers are other processes)."""

    def __init__(self, n: int, log: str) -> None:
        self.n, self.log = n, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        with open(self.log, "a") as out:
            out.write(f"{index}\n")
        return index


def read_beyond(log, epochs: int, n: int = 24) -> collections.Counter[int]:
    """The indices read beyond `epochs` whole epochs of n samples (workers interleave their reads)."""
    read = collections.Counter(int(line) for line in log.read_text().split()) if log.exists() else collections.Counter()
    return read - collections.Counter(list(range(n)) * epochs)


@pytest.mark.parametrize("pin", [None, lambda batch: batch], ids=["cpu", "pinned-on-a-thread"])
def test_the_next_epochs_first_batches_are_read_while_an_epoch_ends_and_used_once(tmp_path, pin):
    """The first batch of epoch 1 is read before its pass starts (no rank waits for a whole batch
    at each epoch's start), delivered in order, and read once; a next pass that starts elsewhere
    (a resume mid-epoch) drops them and reads its own."""
    log = tmp_path / "reads.txt"
    sampler = ShardSampler(24, 4, 0, 1, seed=5)
    loader = WorkerLoader(Logged(24, str(log)), 2, batch_size=4)
    first_of = {epoch: next(sampler.batches(epoch)).tolist() for epoch in (1, 2)}
    try:
        got = [list(b) for b in loader.epoch(sampler.batches(0), pin=pin, epoch=0, following=lambda: sampler.batches(1))]
        assert got == [b.tolist() for b in sampler.batches(0)]
        deadline = time.monotonic() + 30
        while not set(first_of[1]) <= set(read_beyond(log, 1)):  # polled: the workers read it on their own
            assert time.monotonic() < deadline, f"epoch 1's first batch was not read ahead: {read_beyond(log, 1)}"
            time.sleep(0.01)
        got = [list(b) for b in loader.epoch(sampler.batches(1), pin=pin, epoch=1, start=0, following=lambda: sampler.batches(2))]
        assert got == [b.tolist() for b in sampler.batches(1)]
        while not set(first_of[2]) <= set(read_beyond(log, 2)):
            assert time.monotonic() < deadline, f"epoch 2's first batch was not read ahead: {read_beyond(log, 2)}"
            time.sleep(0.01)
        assert not read_beyond(log, 3) and read_beyond(log, 2).total() <= 16  # each sample once an epoch; ahead, in_flight batches at most
        got = [list(b) for b in loader.epoch(sampler.batches(2, start=8), pin=pin, epoch=2, start=8)]
        assert got == [b.tolist() for b in sampler.batches(2, start=8)]  # not the read-ahead's
    finally:
        loader.close()
    assert loader.live == {} and sorted(loader.free) == list(range(loader.in_flight + 2))  # every slot back
