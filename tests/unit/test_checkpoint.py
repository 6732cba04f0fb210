import errno
import io
import json
import os
import pickle
import struct
import threading

import pytest
import torch

from trainers import tensorfile
from trainers.checkpoint import Checkpointer, CheckpointError, load_tensor_file, sha256_of
from trainers.layout import MARKER, step_dir_name


def save(ckpt: Checkpointer, step: int, value: float, asynchronous: bool = False) -> None:
    ckpt.begin_save(step, {"w": torch.full((4,), value), "progress": {"step": step}}, {"rng": torch.tensor([step])}, asynchronous)
    ckpt.wait_written()
    ckpt.commit()


def test_saves_commit_atomically_and_keep_the_last_k(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    for step in (10, 20, 30):
        save(ckpt, step, float(step), asynchronous=step == 20)
    assert [c.step for c in ckpt.committed()] == [20, 30]
    step, shared, own = ckpt.load_latest()
    assert step == 30 and torch.equal(shared["w"], torch.full((4,), 30.0)) and int(own["rng"]) == 30
    ckpt.wait_pruned()
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(20), step_dir_name(30)]


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
    assert "skipping checkpoint" in caplog.text


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

    from trainers.state import check_compatible

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
    shown = subprocess.run([sys.executable, "-m", "trainers.tensorfile", str(path)], capture_output=True, text=True, check=True).stdout
    assert "w: tensor float32[2, 3]" in shown and "step: 7" in shown
    path.write_bytes(b"junk")
    failed = subprocess.run([sys.executable, "-m", "trainers.tensorfile", str(path)], capture_output=True, text=True)
    assert failed.returncode == 1 and failed.stderr.strip() == f"{path}: not a checkpoint tensor file (bad magic)"
