import errno
import io
import json
import os
import pickle
import shutil
import struct
import threading
import time

import pytest
import torch

from trainers.checkpoint import checkpointer as checkpoint_module
from trainers.checkpoint import tensorfile
from trainers.checkpoint.checkpointer import Checkpointer, CheckpointError, HostCopies, load_tensor_file, sha256_of
from trainers.checkpoint.layout import BEST, MARKER, read_best, step_dir_name
from trainers.checkpoint.storage import fsync_path


def save(ckpt: Checkpointer, step: int, value: float, asynchronous: bool = False) -> None:
    ckpt.begin_save(step, {"w": torch.full((4,), value), "progress": {"step": step}}, {"rng": torch.tensor([step])}, asynchronous)
    ckpt.wait_written()
    ckpt.commit()


@pytest.mark.parametrize("damage", ["flip", "truncate", "marker", "missing"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous(tmp_path, damage, caplog):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=3)
    save(ckpt, 1, 1.0)
    save(ckpt, 2, 2.0)
    newest = tmp_path / step_dir_name(2)
    target = newest / "shared.ckpt"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "marker":
        (newest / MARKER).unlink()
    else:
        target.unlink()
    step, shared, _ = ckpt.load_latest()
    assert step == 1 and torch.equal(shared["w"], torch.full((4,), 1.0))
    assert damage == "marker" or "skipping checkpoint" in caplog.text  # without its marker a step is not listed at all


def test_an_interrupted_save_is_never_loaded(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    save(ckpt, 1, 1.0)
    ckpt.begin_save(2, {"w": torch.zeros(4)}, {"rng": torch.tensor([2])}, asynchronous=False)  # no commit: "killed"
    assert Checkpointer(tmp_path, 0, 1, 2).load_latest()[0] == 1


class Evil:
    """Runs a shell command when unpickled."""

    target = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def evil_tensor_file(path, marker) -> None:
    """Our format, but its header pickles an object that runs code (checksums can be faked too)."""
    Evil.target = str(marker)
    buffer = io.BytesIO()
    torch.save({"object": {"w": Evil()}, "tensors": []}, buffer)
    header = buffer.getvalue()
    path.write_bytes(tensorfile.MAGIC + struct.pack("<Q", len(header)) + header)


def test_a_file_that_runs_code_when_unpickled_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    Evil.target = str(marker)
    (tmp_path / "evil.ckpt").write_bytes(pickle.dumps(Evil()))
    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    evil_tensor_file(tmp_path / "evil-header.ckpt", marker)
    for name in ("evil.ckpt", "evil.pt", "evil-header.ckpt"):
        with pytest.raises(CheckpointError, match="cannot be loaded safely"):
            load_tensor_file(tmp_path / name)
    assert not marker.exists()


def test_a_crafted_checkpoint_with_a_valid_marker_is_still_not_executed(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    save(ckpt, 1, 1.0)
    save(ckpt, 2, 2.0)
    marker = tmp_path / "pwned"
    newest = tmp_path / step_dir_name(2)
    evil_tensor_file(newest / "shared.ckpt", marker)
    meta = json.loads((newest / MARKER).read_text())  # an attacker can fix up the checksums too
    meta["files"]["shared.ckpt"] = {"bytes": (newest / "shared.ckpt").stat().st_size, "sha256": sha256_of(newest / "shared.ckpt")}
    (newest / MARKER).write_text(json.dumps(meta))
    assert ckpt.load_latest()[0] == 1 and not marker.exists()


@pytest.mark.parametrize(
    "state",
    [
        {"w": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.int64), "h": torch.randn(2).to(torch.bfloat16)},
        {"empty": torch.empty(0, 3), "scalar": torch.tensor(2.5), "bool": torch.tensor([True, False])},
        {"nested": [(1, "a", torch.ones(2)), {"x": None, "y": 1.5}], "strided": torch.randn(4, 6)[:, ::2], "text": "cfg: 1"},
    ],
)
def test_tensor_files_round_trip_common_dtypes_shapes_and_containers(tmp_path, state):
    path = tmp_path / "state.ckpt"
    nbytes, digest = tensorfile.write_tensor_file(path, state)
    assert nbytes == path.stat().st_size and digest == sha256_of(path)
    loaded = tensorfile.read_tensor_file(path)

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list | tuple):
            return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
        return a == b

    assert same(state, loaded)


def test_truncated_tensor_files_are_refused_with_a_message(tmp_path):
    path = tmp_path / "state.ckpt"
    tensorfile.write_tensor_file(path, {"w": torch.randn(1000)})
    data = path.read_bytes()
    for cut in (4, 12, len(data) - 100):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="cannot be loaded safely: .*(magic|truncated)"):
            load_tensor_file(path)


def test_async_saves_reuse_host_copies_and_never_see_later_changes(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    live = torch.zeros(1000)
    for step in (1, 2):
        live.fill_(float(step))
        ckpt.begin_save(step, {"w": live}, {"rng": torch.tensor([step])}, asynchronous=True)
        live.fill_(-1.0)  # training goes on changing the live tensor while the writer runs
        ckpt.wait_written()
        ckpt.commit()
        step_loaded, shared, _ = ckpt.load_latest()
        assert step_loaded == step and torch.equal(shared["w"], torch.full((1000,), float(step)))
    assert len(ckpt._host_copies._buffers) == 2  # one per tensor, reused by the second save


def test_deferred_tensors_are_copied_by_the_writer_and_the_fence_keeps_the_step_out(tmp_path, monkeypatch):
    """Parameters and optimizer state are copied on the writer thread: begin_save returns before
    they are copied, buffers are copied at once, and after fence() the live tensors are free."""
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    weight, buffer = torch.full((1000,), 1.0), torch.full((10,), 5.0)
    release, copy_started = threading.Event(), threading.Event()
    original_copy = torch.Tensor.copy_

    def slow_copy(self, src, *args, **kwargs):  # the writer's copy waits until the test lets it go
        if src.data_ptr() == weight.data_ptr():
            copy_started.set()
            assert release.wait(10)
        return original_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", slow_copy)
    ckpt.begin_save(1, {"w": weight, "running_mean": buffer}, {"rng": torch.tensor([1])}, asynchronous=True, later=lambda t: t.data_ptr() == weight.data_ptr())
    assert copy_started.wait(10)  # begin_save returned with the weight not yet copied
    buffer.fill_(-5.0)  # forward changes buffers at once: they were copied before begin_save returned
    assert not ckpt._copied.is_set()
    release.set()
    ckpt.fence()
    assert ckpt._copied.is_set()  # the fence returns once the weights are copied
    weight.fill_(-1.0)  # the optimizer step, after the fence
    monkeypatch.undo()
    ckpt.wait_written()
    ckpt.commit()
    _, shared, _ = ckpt.load_latest()
    assert torch.equal(shared["w"], torch.full((1000,), 1.0)) and torch.equal(shared["running_mean"], torch.full((10,), 5.0))
    assert ckpt.fence() == 0.0  # nothing pending


def test_a_failed_deferred_copy_never_hangs_the_fence_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    save(ckpt, 1, 1.0)
    weight = torch.zeros(8)
    original_copy = torch.Tensor.copy_

    def failing(self, src, *args, **kwargs):
        if src.data_ptr() == weight.data_ptr():
            raise RuntimeError("out of memory")
        return original_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", failing)
    ckpt.begin_save(2, {"w": weight}, {"rng": torch.tensor([2])}, asynchronous=True, later=lambda t: t.data_ptr() == weight.data_ptr())
    ckpt.fence()  # returns: the writer gave up
    with pytest.raises(CheckpointError, match="writing the checkpoint failed: out of memory; the previous committed checkpoint is intact"):
        ckpt.wait_written()
    monkeypatch.undo()
    assert ckpt.load_latest()[0] == 1


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    save(ckpt, 1, 1.0)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    ckpt.begin_save(2, {"w": torch.zeros(4)}, {"rng": torch.tensor([2])}, asynchronous=True)
    with pytest.raises(CheckpointError, match="No space left on device; the previous committed checkpoint is intact"):
        ckpt.wait_written()
    monkeypatch.undo()
    assert ckpt.load_latest()[0] == 1


def test_keep_one_and_unwritable_dirs_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="keep at least 2"):
        Checkpointer(tmp_path, 0, 1, keep=1)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot be created"):
        Checkpointer(tmp_path / "a-file" / "checkpoints", 0, 1, keep=2)  # fails for root too
    # An unwritable directory (root included): tests/unit/test_unwritable.py.


def test_commit_refuses_when_a_rank_did_not_write(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=2, keep=2)
    ckpt.begin_save(5, {"w": torch.zeros(1)}, {"rng": torch.tensor([0])}, asynchronous=False)
    with pytest.raises(CheckpointError, match="rank-00001.ckpt"):
        ckpt.commit()


def test_resuming_a_different_model_is_refused_naming_the_layer():
    from torch import nn

    from trainers.checkpoint.state import check_compatible

    saved = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).state_dict()
    with pytest.raises(CheckpointError, match=r"checkpoint step 7 does not fit this model: 0.bias is \(16,\) there and \(32,\) here"):
        check_compatible(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), saved, 7)
    with pytest.raises(CheckpointError, match="'3.bias' is missing from the checkpoint"):
        check_compatible(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4)), saved, 7)


def test_the_file_viewer_shows_structure_and_refuses_other_files(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "state.ckpt"
    tensorfile.write_tensor_file(path, {"model": {"w": torch.zeros(2, 3)}, "progress": {"step": 7}})
    shown = subprocess.run([sys.executable, "-m", "trainers.checkpoint.tensorfile", str(path)], capture_output=True, text=True, check=True).stdout
    assert "w: tensor float32[2, 3]" in shown and "step: 7" in shown
    path.write_bytes(b"junk")
    failed = subprocess.run([sys.executable, "-m", "trainers.checkpoint.tensorfile", str(path)], capture_output=True, text=True)
    assert failed.returncode == 1 and failed.stderr.strip() == f"{path}: not a checkpoint tensor file (bad magic)"


# --- what mutation testing found unguarded (issue 46: scripts/mutation.py --module trainers.checkpoint.checkpointer)


def test_host_copies_follow_a_tensor_whose_shape_or_dtype_changed(tmp_path):
    """The kept host buffer is reused only for the same shape and dtype (a resized embedding, a
    cast): otherwise a new one, never a copy into the old one's shape."""
    copies = HostCopies()
    first, _ = copies.snapshot({"w": torch.ones(4)})
    wider, _ = copies.snapshot({"w": torch.full((6,), 2.0)})
    cast, _ = copies.snapshot({"w": torch.full((6,), 3, dtype=torch.int64)})
    assert torch.equal(first["w"], torch.ones(4)) and torch.equal(wider["w"], torch.full((6,), 2.0))
    assert cast["w"].dtype == torch.int64 and torch.equal(cast["w"], torch.full((6,), 3, dtype=torch.int64))


def test_a_checkpoint_dir_is_made_with_its_parents_and_a_leftover_tmp_of_the_same_step_is_reused(tmp_path):
    """A save of a step whose save was interrupted before (a restart saves the same step again)
    writes into the leftover temporary dir; the checkpoint dir may be several levels new."""
    ckpt = Checkpointer(tmp_path / "runs" / "a" / "checkpoints", rank=0, world_size=1, keep=2)
    ckpt.begin_save(3, {"w": torch.zeros(4)}, {"rng": torch.tensor([3])}, asynchronous=False)  # never committed: "killed"
    again = Checkpointer(tmp_path / "runs" / "a" / "checkpoints", rank=0, world_size=1, keep=2)
    save(again, 3, 7.0)
    step, shared, _ = again.load_latest()
    assert step == 3 and torch.equal(shared["w"], torch.full((4,), 7.0))


def test_a_second_async_save_waits_for_the_first_one_s_writer(tmp_path, monkeypatch):
    """begin_save reuses the host buffers: it must not copy the next state into them while the
    previous save is still writing them, or that save's files hold the next step's values."""
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=3)
    release, writing = threading.Event(), threading.Event()
    original = checkpoint_module.save_tensor_file

    def held(path, obj):  # the first save's writer waits until the test lets it go
        if "step-000000001" in str(path):
            writing.set()
            assert release.wait(10)
        original(path, obj)

    monkeypatch.setattr(checkpoint_module, "save_tensor_file", held)
    live = torch.full((4,), 1.0)
    ckpt.begin_save(1, {"w": live}, {"rng": torch.tensor([1])}, asynchronous=True)
    assert writing.wait(10)
    assert not ckpt.written()  # the pending save is still being written
    live.fill_(2.0)
    second = threading.Thread(target=ckpt.begin_save, args=(2, {"w": live}, {"rng": torch.tensor([2])}, True))
    second.start()
    second.join(0.5)  # must still be waiting: returning here would have overwritten step 1's buffers
    returned_early = not second.is_alive()
    release.set()
    second.join(10)
    assert not returned_early, "the second save copied into the buffers the first was writing"
    ckpt.wait_written()
    assert ckpt.written()
    assert torch.equal(load_tensor_file(tmp_path / ".tmp-step-000000001" / "shared.ckpt")["w"], torch.full((4,), 1.0))


def test_the_fence_reports_the_seconds_it_waited(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    weight = torch.ones(8)
    original_copy = torch.Tensor.copy_
    started = threading.Event()

    def slow(self, src, *args, **kwargs):
        if src.data_ptr() == weight.data_ptr():
            started.set()
            time.sleep(0.05)  # the copy's own duration: what the fence waits for
        return original_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", slow)
    begun = time.perf_counter()
    ckpt.begin_save(1, {"w": weight}, {"rng": torch.tensor([1])}, asynchronous=True, later=lambda t: t.data_ptr() == weight.data_ptr())
    assert started.wait(10)
    waited = ckpt.fence()
    assert 0.0 < waited <= time.perf_counter() - begun
    ckpt.wait_written()


def test_only_rank_0_publishes_and_commit_names_the_checkpoint(tmp_path):
    rank1 = Checkpointer(tmp_path, rank=1, world_size=2, keep=2)
    rank0 = Checkpointer(tmp_path, rank=0, world_size=2, keep=2)
    rank1.begin_save(4, None, {"rng": torch.tensor([1])}, asynchronous=False)
    rank0.begin_save(4, {"w": torch.zeros(2)}, {"rng": torch.tensor([0])}, asynchronous=False)
    assert rank1.commit() is None and not (tmp_path / step_dir_name(4)).exists()  # rank 1 wrote, rank 0 publishes
    assert rank0.commit() == str(tmp_path / step_dir_name(4))
    assert [c.step for c in rank0.committed()] == [4]
    assert [int(state["rng"]) for state in rank0.rank_states(4)] == [0, 1]  # every rank's own file, in rank order


def test_leftovers_of_a_killed_prune_are_removed_and_never_block_the_next(tmp_path):
    """A process killed while deleting an old checkpoint leaves `.old-step-N`: the next commit
    that prunes step N again replaces it, and the next prune deletes every such leftover."""
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    save(ckpt, 1, 1.0)
    save(ckpt, 2, 2.0)
    (tmp_path / f".old-{step_dir_name(1)}").mkdir()
    (tmp_path / f".old-{step_dir_name(1)}" / "partial").write_text("x")
    (tmp_path / f".old-{step_dir_name(0)}").mkdir()  # an older leftover
    save(ckpt, 3, 3.0)
    ckpt.wait_pruned()
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(2), step_dir_name(3)]


def test_the_best_checkpoint_is_recorded_by_rank_0_and_kept_through_pruning(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    other = Checkpointer(tmp_path / "rank1", rank=1, world_size=2, keep=2)
    save(ckpt, 1, 1.0)
    ckpt.mark_best(1, "val_loss", 0.25, "min")
    other.mark_best(1, "val_loss", 0.25, "min")
    assert not (tmp_path / "rank1" / BEST).exists() and other.best["step"] == 1  # rank 1 knows it, rank 0 writes it
    assert read_best(tmp_path) == {"step": 1, "metric": "val_loss", "value": 0.25, "mode": "min", "path": step_dir_name(1)}
    assert Checkpointer(tmp_path, rank=0, world_size=1, keep=2).best == read_best(tmp_path)  # read back on a restart
    for step in (2, 3, 4):
        save(ckpt, step, float(step))
    ckpt.wait_pruned()
    assert [c.step for c in ckpt.committed()] == [1, 3, 4]  # the best outlives the newest two


def test_a_named_step_loads_as_the_latest_would_and_a_world_size_change_gives_no_own_state(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=3)
    save(ckpt, 1, 1.0)
    save(ckpt, 2, 2.0)
    step, shared, own = ckpt.load_step(1)
    assert step == 1 and torch.equal(shared["w"], torch.full((4,), 1.0)) and int(own["rng"]) == 1
    resized = Checkpointer(tmp_path, rank=0, world_size=2, keep=3)
    assert resized.load_step(2)[2] is None and resized.load_latest()[2] is None
    with pytest.raises(CheckpointError, match="no COMMITTED marker"):
        ckpt.load_step(9)


def test_syncing_a_directory_closes_what_it_opens(tmp_path):
    """Every commit syncs two directories: a leaked descriptor per call runs a long job out of them."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        fsync_path(tmp_path)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_prune_waits_for_the_previous_deletion(tmp_path, monkeypatch):
    """One deleter at a time: a commit that prunes while the last prune's deletion still runs
    waits for it, so wait_pruned (before exit) covers every deletion begun."""
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    save(ckpt, 1, 1.0)
    save(ckpt, 2, 2.0)
    release, deleting = threading.Event(), threading.Event()
    original = shutil.rmtree

    def held(path, *args, **kwargs):
        if step_dir_name(1) in str(path):
            deleting.set()
            assert release.wait(10)
        original(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", held)
    save(ckpt, 3, 3.0)  # prunes step 1: its deletion is held
    assert deleting.wait(10)
    later = threading.Thread(target=save, args=(ckpt, 4, 4.0))
    later.start()
    later.join(0.5)  # must still be waiting for step 1's deletion
    returned_early = not later.is_alive()
    release.set()
    later.join(10)
    ckpt.wait_pruned()
    assert not returned_early, "a second deleter started beside the first"
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(3), step_dir_name(4)]
