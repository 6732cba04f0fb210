import errno
import json
import os
import pickle

import pytest
import torch

from trainers.checkpoint import MARKER, CheckpointError, Checkpointer, load_tensor_file, step_dir_name


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
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "marker", "missing"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous(tmp_path, damage, caplog):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=3)
    save(ckpt, 1, 1.0)
    save(ckpt, 2, 2.0)
    newest = tmp_path / step_dir_name(2)
    target = newest / "shared.pt"
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


def test_a_file_that_runs_code_when_unpickled_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        load_tensor_file(path)
    torch.save({"x": Evil()}, tmp_path / "evil2.pt")
    with pytest.raises(CheckpointError):
        load_tensor_file(tmp_path / "evil2.pt")
    assert not marker.exists()


def test_a_crafted_checkpoint_with_a_valid_marker_is_still_not_executed(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    save(ckpt, 1, 1.0)
    save(ckpt, 2, 2.0)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    newest = tmp_path / step_dir_name(2)
    torch.save({"w": Evil()}, newest / "shared.pt")
    meta = json.loads((newest / MARKER).read_text())  # an attacker can fix up the checksums too
    from trainers.checkpoint import sha256_of

    meta["files"]["shared.pt"] = {"bytes": (newest / "shared.pt").stat().st_size, "sha256": sha256_of(newest / "shared.pt")}
    (newest / MARKER).write_text(json.dumps(meta))
    assert ckpt.load_latest()[0] == 1 and not marker.exists()


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep=2)
    save(ckpt, 1, 1.0)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
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
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permission bits do not stop us")
        with pytest.raises(CheckpointError, match="not writable"):
            Checkpointer(locked, 0, 1, keep=2)
    finally:
        locked.chmod(0o700)


def test_commit_refuses_when_a_rank_did_not_write(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=2, keep=2)
    ckpt.begin_save(5, {"w": torch.zeros(1)}, {"rng": torch.tensor([0])}, asynchronous=False)
    with pytest.raises(CheckpointError, match="rank-00001.pt"):
        ckpt.commit()


def test_resuming_a_different_model_is_refused_naming_the_layer():
    from torch import nn

    from trainers.state import check_compatible

    saved = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).state_dict()
    with pytest.raises(CheckpointError, match=r"checkpoint step 7 does not fit this model: 0.bias is \(16,\) there and \(32,\) here"):
        check_compatible(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), saved, 7)
    with pytest.raises(CheckpointError, match="'3.bias' is missing from the checkpoint"):
        check_compatible(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4)), saved, 7)
