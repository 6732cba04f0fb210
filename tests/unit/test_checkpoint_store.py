"""The Checkpointer's guarantees in both stores (trainers.checkpoint.storage): the run dir's checkpoints/ and
an object store, a real S3-compatible server (scripts/s3-sim.sh). Keep-K pruning, a damaged
newest checkpoint skipped for the previous one, every rank's piece, best.json, and a server cut
mid-save: a failed save, the previous checkpoint still the newest, never a corrupt resume."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.support.tcp_fault import CuttableProxy
from trainers.checkpoint.checkpointer import Checkpointer, CheckpointError
from trainers.checkpoint.layout import MARKER, SHARED, step_dir_name
from trainers.checkpoint.storage import POINTER, LocalStore, ObjectStore, open_store, run_location, run_store, stored_checkpoints


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "checkpoints")
    return ObjectStore(request.getfixturevalue("s3"), tmp_path / "staging", attempts=3, first_wait_s=0.05)


def save(ckpt: Checkpointer, step: int, value: float, asynchronous: bool = False) -> None:
    ckpt.begin_save(step, {"w": torch.full((4,), value), "progress": {"step": step}}, {"rng": torch.tensor([step])}, asynchronous)
    ckpt.wait_written()
    ckpt.commit()


def pieces(store, step: int) -> list[str]:
    """The names the store holds for `step` (files or objects), the marker included."""
    if isinstance(store, LocalStore):
        directory = store.root / step_dir_name(step)
        return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    store.fs.invalidate_cache()
    return sorted(path.rsplit("/", 1)[1] for path in store.fs.find(store.key(step)))


def overwrite(store, step: int, name: str, data: bytes) -> None:
    if isinstance(store, LocalStore):
        (store.root / step_dir_name(step) / name).write_bytes(data)
    else:
        store.fs.pipe_file(store.key(step, name), data)


def test_saves_commit_keep_the_newest_two_and_prune_the_rest_whole(store):
    ckpt = Checkpointer(store, rank=0, world_size=1, keep=2)
    for step in (10, 20, 30):
        save(ckpt, step, float(step), asynchronous=step == 20)
    assert [c.step for c in ckpt.committed()] == [20, 30]
    step, shared, own = ckpt.load_latest()
    assert step == 30 and torch.equal(shared["w"], torch.full((4,), 30.0)) and int(own["rng"]) == 30
    ckpt.wait_pruned()
    assert pieces(store, 10) == []  # every object of a pruned step, not its marker alone
    assert pieces(store, 30) == sorted([MARKER, SHARED, f"{SHARED}.sum", "rank-00000.ckpt", "rank-00000.ckpt.sum"])
    if isinstance(store, ObjectStore):
        assert not any(store.staging_root.rglob("*.ckpt"))  # uploaded and loaded: no local copy is kept
    else:  # no staging or retired directory left beside the two kept
        assert sorted(p.name for p in store.root.iterdir()) == [step_dir_name(20), step_dir_name(30)]


@pytest.mark.parametrize("damage", ["flip", "truncate", "marker", "missing"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous(store, damage, caplog):
    ckpt = Checkpointer(store, rank=0, world_size=1, keep=3)
    save(ckpt, 1, 1.0)
    save(ckpt, 2, 2.0)
    data = store.read(2, SHARED)
    if damage == "flip":
        overwrite(store, 2, SHARED, data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :])
    elif damage == "truncate":
        overwrite(store, 2, SHARED, data[:100])
    elif damage == "marker":
        overwrite(store, 2, MARKER, b"{not json")
    elif isinstance(store, ObjectStore):
        store.fs.rm_file(store.key(2, SHARED))
    else:
        (store.root / step_dir_name(2) / SHARED).unlink()
    with caplog.at_level(logging.WARNING, logger="trainers.checkpoint.checkpointer"):
        restarted = Checkpointer(store, rank=0, world_size=1, keep=3)
        step, shared, _ = restarted.load_latest()
    if isinstance(store, LocalStore) or damage != "flip":  # a local listing hashes; an object store's checks sizes (its pieces are hashed as fetched)
        assert [c.step for c in restarted.committed()] == [1]
    assert step == 1 and torch.equal(shared["w"], torch.full((4,), 1.0))
    expected = {"flip": "does not match its checksum", "truncate": "does not match its checksum", "marker": "unreadable COMMITTED", "missing": "is missing"}
    assert expected[damage] in caplog.text


def test_every_rank_writes_its_own_piece_and_rank_0_publishes_them_together(store):
    rank1 = Checkpointer(store, rank=1, world_size=2, keep=2)
    rank0 = Checkpointer(store, rank=0, world_size=2, keep=2)
    rank1.begin_save(4, None, {"rng": torch.tensor([1])}, asynchronous=True)
    rank0.begin_save(4, {"w": torch.zeros(2)}, {"rng": torch.tensor([0])}, asynchronous=False)
    rank1.wait_written()
    assert rank1.commit() is None and store.committed_steps() == []  # rank 1 wrote, rank 0 publishes
    assert rank0.commit().endswith(step_dir_name(4))
    assert [int(state["rng"]) for state in rank0.rank_states(4)] == [0, 1]  # every rank's own piece, in rank order
    assert int(Checkpointer(store, rank=1, world_size=2, keep=2).load_latest()[2]["rng"]) == 1


def test_a_commit_missing_a_ranks_piece_is_refused_and_publishes_nothing(store):
    rank0 = Checkpointer(store, rank=0, world_size=2, keep=2)
    rank0.begin_save(7, {"w": torch.zeros(2)}, {"rng": torch.tensor([0])}, asynchronous=False)
    with pytest.raises(CheckpointError, match=r"step 7: files \['rank-00001.ckpt'\] were not written"):
        rank0.commit()
    assert store.committed_steps() == []


def test_the_best_checkpoint_is_recorded_in_the_store_and_never_pruned(store):
    ckpt = Checkpointer(store, rank=0, world_size=1, keep=2)
    save(ckpt, 1, 1.0)
    ckpt.mark_best(1, "val_loss", 0.25, "min")
    for step in (2, 3, 4):
        save(ckpt, step, float(step))
    ckpt.wait_pruned()
    assert store.committed_steps() == [1, 3, 4]
    assert Checkpointer(store, rank=0, world_size=1, keep=2).best["step"] == 1  # read back on a restart


def test_a_server_cut_mid_save_fails_the_save_and_a_resume_finds_the_previous_checkpoint(s3, tmp_path, monkeypatch):
    proxy = CuttableProxy(("127.0.0.1", int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        ckpt = Checkpointer(ObjectStore(s3, tmp_path / "staging", attempts=2, first_wait_s=0.05), rank=0, world_size=1, keep=2)
        save(ckpt, 10, 10.0)
        ckpt.wait_pruned()
        proxy.sever()  # the server goes away while step 20 is written
        ckpt.begin_save(20, {"w": torch.full((4,), 20.0)}, {"rng": torch.tensor([20])}, asynchronous=True)
        failed = r"uploading step-000000020/rank-00000.ckpt .* failed after 2 attempts.*previous committed checkpoint is intact"
        with pytest.raises(CheckpointError, match=rf"writing the checkpoint failed: {failed}"):
            ckpt.wait_written()
        assert ckpt.commit() is None  # nothing pending: the failed save is not published
        proxy.mend()
        restarted = Checkpointer(ObjectStore(s3, tmp_path / "restarted", attempts=2, first_wait_s=0.05), rank=0, world_size=1, keep=2)
        step, shared, _ = restarted.load_latest()
        assert step == 10 and torch.equal(shared["w"], torch.full((4,), 10.0))
        # Cut after the pieces, before the marker: the same, and the next commit sweeps the pieces away
        restarted.begin_save(30, {"w": torch.full((4,), 30.0)}, {"rng": torch.tensor([30])}, asynchronous=False)
        proxy.sever()
        with pytest.raises(CheckpointError, match=r"committing the checkpoint failed: .*step-000000030.* failed after 2 attempts"):
            restarted.commit()
        proxy.mend()
        assert restarted.store.committed_steps() == [10] and pieces(restarted.store, 30)
        save(restarted, 40, 40.0)
        restarted.wait_pruned()
        assert restarted.store.committed_steps() == [10, 40] and pieces(restarted.store, 30) == []
    finally:
        proxy.close()


def test_a_run_keeps_its_own_place_under_the_uri_and_its_run_dir_names_it_without_secrets(s3, tmp_path, caplog):
    first, second = tmp_path / "sweep" / "0", tmp_path / "other" / "0"
    location = run_location(s3, first)
    assert location.startswith(f"{s3}/0-") and location != run_location(s3, second) and location == run_location(s3 + "/", first)
    with caplog.at_level(logging.DEBUG):
        ckpt = Checkpointer(run_store(first / "checkpoints", s3), rank=0, world_size=1, keep=2)
        save(ckpt, 5, 5.0)
    assert (first / "checkpoints" / POINTER).read_text().strip() == location
    found = stored_checkpoints(first / "checkpoints")  # what hpc.status and export read from the run dir
    assert isinstance(found, ObjectStore) and found.url == location and found.committed_steps() == [5]
    assert isinstance(stored_checkpoints(second / "checkpoints"), LocalStore)  # no pointer: the run dir's own checkpoints
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    written = "".join(p.read_text(errors="replace") for p in first.rglob("*") if p.is_file())
    assert secret not in written and secret not in caplog.text
    assert isinstance(open_store(str(tmp_path / "elsewhere"), tmp_path), LocalStore)


def test_a_run_whose_checkpoints_are_in_s3_exports_by_its_run_dir_and_by_its_url_as_documented(s3, tmp_path, capsys):
    """docs/checkpoints.md's two export lines, run as written (python: this interpreter) on a run
    trained with checkpoint.uri; both give the run's newest checkpoint, byte for byte the same."""
    import dataclasses
    import subprocess
    import sys

    from hpc.rundir import RunDir
    from hpc.tools.status import newest_checkpoint
    from tests.support.docs import marked_blocks
    from tests.support.fit_in_process import Regression, train
    from tests.support.fit_in_process import config as task_config

    cfg = task_config(max_steps=6, every_steps=2)
    result = train(tmp_path / "run", Regression(), dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, uri=s3)))
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))  # in the store, not the run dir
    assert newest_checkpoint(RunDir(tmp_path / "run")) == result.steps  # hpc.status's column, from the store
    (block,) = marked_blocks("docs/checkpoints.md", __file__)
    lines = [line for line in block.body.splitlines() if line.strip()]
    assert len(lines) == 2 and all(line.startswith("python -m trainers.export ") for line in lines), lines
    outputs = []
    for number, line in enumerate(lines):
        out = tmp_path / f"model-{number}.safetensors"
        command = line.replace("RUN_DIR", str(tmp_path / "run")).replace("model.safetensors", str(out)).replace("python ", f"{sys.executable} ", 1)
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"model of checkpoint step {result.steps} " in done.stdout
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    from trainers.checkpoint.export import main

    assert main([f"{s3}/no-such-run", "--out", str(tmp_path / "x.safetensors")]) == 2  # in this process: the store opened from a URL
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {s3}/no-such-run holds no committed checkpoint"]


def test_hpc_status_shows_no_step_for_a_store_it_cannot_reach_and_says_why_in_one_line(s3, tmp_path, monkeypatch, caplog):
    from hpc.rundir import RunDir
    from hpc.tools.status import newest_checkpoint

    run_store(tmp_path / "run" / "checkpoints", s3)
    proxy = CuttableProxy(("127.0.0.1", 9))  # nothing listens behind it
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    proxy.sever()
    try:
        with caplog.at_level(logging.WARNING, logger="trainers.checkpoint.storage"):
            assert newest_checkpoint(RunDir(tmp_path / "run")) is None
    finally:
        proxy.close()
    assert f"checkpoints of {tmp_path / 'run'} not listed: listing checkpoints (s3://" in caplog.text


def test_a_listing_that_fails_after_a_commit_skips_pruning_and_one_at_a_resume_is_restartable(tmp_path, caplog):
    """The store goes away between a commit and its pruning (seen in CI): the commit stands and
    training goes on; at a resume the same failure is StoreUnavailable (hpc.rank.failures restarts)."""
    from trainers.checkpoint.checkpointer import StoreUnavailable
    from trainers.checkpoint.storage import StoreError

    class Flaky(LocalStore):
        down = False

        def committed_steps(self) -> list[int]:
            if self.down:
                raise StoreError("listing checkpoints (here) failed after 5 attempts: ConnectionClosedError", transient=True)
            return super().committed_steps()

    store = Flaky(tmp_path / "checkpoints")
    ckpt = Checkpointer(store, rank=0, world_size=1, keep=2)
    ckpt.begin_save(1, {"w": torch.zeros(1)}, {"rng": torch.tensor([1])}, asynchronous=False)
    store.down = True
    with caplog.at_level(logging.WARNING, logger="trainers.checkpoint.checkpointer"):
        assert ckpt.commit().endswith(step_dir_name(1))
    assert "pruning old checkpoints skipped: listing the checkpoints failed: listing checkpoints (here) failed after 5 attempts" in caplog.text
    with pytest.raises(StoreUnavailable, match=r"^listing the checkpoints failed: .*; the previous committed checkpoint is intact$"):
        Checkpointer(store, rank=0, world_size=1, keep=2).load_latest()
    store.down = False
    assert store.committed_steps() == [1]
