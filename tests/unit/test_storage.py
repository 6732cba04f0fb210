"""Checkpoint stores (trainers/checkpoint/storage.py): the local directory and an object store, the latter
against a real S3-compatible server (scripts/s3-sim.sh: moto's), reached directly or through a
proxy that can be cut mid-save. The marker comes last, only marked steps are listed, a store
that errors fails the save after its retries and leaves the committed steps as they were."""

from __future__ import annotations

import threading

import pytest

from tests.support.tcp_fault import CuttableProxy
from trainers.checkpoint.layout import MARKER, STEP_PREFIX, step_dir_name
from trainers.checkpoint.storage import LocalStore, ObjectStore, StoreError, open_store, retried, run_store


def stage(store, step: int, pieces: dict[str, bytes], staging) -> None:
    for name, data in pieces.items():
        path = staging / f".tmp-{step_dir_name(step)}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        store.put(step, name, path)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_step_is_listed_only_once_its_marker_is_written_and_its_pieces_read_back(kind, tmp_path, request):
    location = str(tmp_path / "checkpoints") if kind == "local" else request.getfixturevalue("s3")
    store = open_store(location, tmp_path / "staging")
    assert isinstance(store, LocalStore if kind == "local" else ObjectStore)
    staging = store.root if isinstance(store, LocalStore) else tmp_path / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    stage(store, 5, {"shared.ckpt": b"s" * 1000, "rank-00000.ckpt": b"r0"}, staging)
    assert store.committed_steps() == []  # pieces without a marker are no checkpoint
    store.commit(5, b'{"step": 5}')
    stage(store, 9, {"shared.ckpt": b"t" * 10}, staging)
    assert store.committed_steps() == [5]
    store.commit(9, b'{"step": 9}')
    assert store.committed_steps() == [5, 9]
    assert store.read(5, MARKER) == b'{"step": 5}'
    assert store.fetch(5, "shared.ckpt").read_bytes() == b"s" * 1000 and store.fetch(5, "rank-00000.ckpt").read_bytes() == b"r0"
    store.remove(5)
    assert store.committed_steps() == [9]
    stage(store, 9, {"shared.ckpt": b"new"}, staging)  # the same step saved again after a restart: the new one wins
    store.commit(9, b'{"step": 9, "again": true}')
    assert store.read(9, MARKER) == b'{"step": 9, "again": true}' and store.fetch(9, "shared.ckpt").read_bytes() == b"new"


def test_an_object_store_cut_mid_save_fails_the_save_and_the_committed_step_stays_the_newest(s3, tmp_path, monkeypatch):
    import os

    proxy = CuttableProxy(("127.0.0.1", int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        store = ObjectStore(s3, tmp_path, attempts=3, first_wait_s=0.05)
        stage(store, 10, {"shared.ckpt": b"a" * 100}, tmp_path)
        store.commit(10, b'{"step": 10}')
        stage(store, 20, {"shared.ckpt": b"b" * 100}, tmp_path)
        proxy.sever()  # the server goes away between two pieces of step 20
        with pytest.raises(StoreError, match=r"uploading step-000000020/rank-00000.ckpt \(s3://.*\) failed after 3 attempts"):
            stage(store, 20, {"rank-00000.ckpt": b"c" * 100}, tmp_path)
        with pytest.raises(StoreError, match=r"committing step-000000020 .* failed after 3 attempts"):
            store.commit(20, b'{"step": 20}')
        proxy.mend()
        assert store.committed_steps() == [10]  # step 20's piece is there, unmarked: no checkpoint
        assert store.fetch(10, "shared.ckpt").read_bytes() == b"a" * 100
        # Gone for a moment only: the retries (0.05, 0.1, 0.2 ... s) carry the save through
        patient = ObjectStore(s3, tmp_path, attempts=6, first_wait_s=0.05)
        proxy.sever()
        threading.Timer(0.2, proxy.mend).start()
        stage(patient, 30, {"shared.ckpt": b"d" * 100}, tmp_path)
        patient.commit(30, b'{"step": 30}')
        assert patient.committed_steps() == [10, 30]
    finally:
        proxy.close()


def test_a_missing_bucket_fails_at_once_naming_it(s3, tmp_path):
    store = ObjectStore("s3://no-such-bucket-hpctk/x", tmp_path, attempts=5, first_wait_s=10)  # a retry would take 10 s
    with pytest.raises(StoreError, match=r"uploading step-000000001/shared.ckpt \(s3://no-such-bucket-hpctk/x\) failed: ") as failed:
        stage(store, 1, {"shared.ckpt": b"x"}, tmp_path)
    assert failed.value.transient is False  # no restart mends it (hpc.rank.failures)


def test_retries_wait_twice_as_long_each_time_then_give_up(monkeypatch):
    import trainers.checkpoint.storage as storage

    waits: list[float] = []
    monkeypatch.setattr(storage.time, "sleep", waits.append)
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "done"

    assert retried("uploading", flaky, attempts=4, first_wait_s=0.5) == "done" and waits == [0.5, 1.0]
    assert len(calls) == 3
    waits.clear()
    with pytest.raises(StoreError, match=r"^uploading failed after 2 attempts: ConnectionResetError: reset by peer$") as failed:
        retried("uploading", lambda: (_ for _ in ()).throw(ConnectionResetError("reset by peer")), attempts=2, first_wait_s=0.25)
    assert waits == [0.25] and failed.value.transient is True  # a later start may find the store back


def test_an_object_store_leaves_no_local_copies_and_removes_every_object_of_a_step(s3, tmp_path):
    store = ObjectStore(s3, tmp_path / "staging")
    stage(store, 3, {"shared.ckpt": b"x" * 10, "rank-00000.ckpt": b"y"}, tmp_path / "staging")
    assert not list(store.staging(3).iterdir())  # each piece deleted once uploaded, before any commit (other ranks' nodes)
    store.commit(3, b'{"step": 3}')
    assert not store.staging(3).exists()  # the staged pieces are uploaded: the local disk keeps no copy
    fetched = store.fetch(3, "shared.ckpt")
    store.remove(3)
    assert store.fs.find(store.key(3)) == [] and not fetched.exists()


def test_two_ranks_of_one_machine_fetch_the_same_piece_without_taking_each_other_s_copy(s3, tmp_path):
    # Both ranks' stores stage under the one run dir: a copy one rank releases (deletes) must not
    # be the file the other is still reading (seen: FileNotFoundError on resume from S3).
    writer = ObjectStore(s3, tmp_path / "staging")
    stage(writer, 5, {"shared.ckpt": b"z" * 32}, tmp_path / "staging")
    writer.commit(5, b'{"step": 5}')
    rank0, rank1 = ObjectStore(s3, tmp_path / "staging"), ObjectStore(s3, tmp_path / "staging")
    first, second = rank0.fetch(5, "shared.ckpt"), rank1.fetch(5, "shared.ckpt")
    rank0.release(first)
    assert second.read_bytes() == b"z" * 32 and not first.exists()
    rank1.remove(5)
    assert not second.exists()
    assert [path.name for path in (tmp_path / "staging" / "fetched").iterdir()] == [rank1.client]  # rank 0 left no empty directory


def test_a_client_s_download_directory_goes_with_its_last_copy(s3, tmp_path):
    store = ObjectStore(s3, tmp_path / "staging")
    stage(store, 5, {"a.ckpt": b"a", "b.ckpt": b"b"}, tmp_path / "staging")
    store.commit(5, b'{"step": 5}')
    first, second = store.fetch(5, "a.ckpt"), store.fetch(5, "b.ckpt")
    store.release(first)
    assert not first.exists() and second.read_bytes() == b"b"  # another copy still held: the directory stays
    store.release(second)
    assert not store.downloads.exists()
    with pytest.raises(StoreError, match="downloading step-000000005/missing.ckpt"):
        store.fetch(5, "missing.ckpt")
    assert not store.downloads.exists()  # a failed download holds nothing either


def test_a_listing_sees_what_another_client_committed_since(s3, tmp_path):
    reader, writer = ObjectStore(s3, tmp_path / "r"), ObjectStore(s3, tmp_path / "w")
    assert reader.committed_steps() == []
    stage(writer, 4, {"shared.ckpt": b"z"}, tmp_path / "w")
    writer.commit(4, b'{"step": 4}')
    assert reader.committed_steps() == [4]  # not the reader's cached listing


def test_a_local_store_removes_a_step_whole(tmp_path):
    store = LocalStore(tmp_path)
    stage(store, 2, {"shared.ckpt": b"x"}, tmp_path)
    store.commit(2, b"{}")
    store.remove(2)
    assert list(tmp_path.iterdir()) == []


def test_an_error_no_retry_mends_is_raised_at_once(monkeypatch):
    import botocore.exceptions  # noqa: F401 - imported, as s3fs's client imports it: its errors are told apart

    import trainers.checkpoint.storage as storage

    waits: list[float] = []
    monkeypatch.setattr(storage.time, "sleep", waits.append)
    for error in (ValueError("bad argument"), FileNotFoundError("no such bucket"), PermissionError("denied")):
        with pytest.raises(StoreError, match=rf"^listing failed: {type(error).__name__}: "):
            retried("listing", lambda error=error: (_ for _ in ()).throw(error), attempts=3)
    assert waits == []
    with pytest.raises(StoreError, match=r"failed after 3 attempts: EndpointConnectionError"):
        retried("listing", lambda: (_ for _ in ()).throw(botocore.exceptions.EndpointConnectionError(endpoint_url="http://x")), attempts=3)
    assert waits == [0.5, 1.0]


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_leftovers_of_earlier_saves_go_and_a_newer_save_under_way_stays(kind, tmp_path, request):
    location = str(tmp_path / "checkpoints") if kind == "local" else request.getfixturevalue("s3")
    store = open_store(location, tmp_path / "checkpoints")
    staging = tmp_path / "checkpoints"
    for step in (3, 9):  # a save cut before its commit, and one other ranks have begun
        store.staging(step).mkdir(parents=True)
        (store.staging(step) / "rank-00001.ckpt").write_bytes(b"r")
    (staging / f"{STEP_PREFIX}junk").mkdir()  # a stray directory, even with a marker, is no step
    (staging / f"{STEP_PREFIX}junk" / MARKER).write_text("{}")
    stage(store, 5, {"shared.ckpt": b"s"}, staging)
    store.commit(5, b"{}")
    store.remove_leftovers(5)
    assert not store.staging(3).exists() and (store.staging(9) / "rank-00001.ckpt").is_file()
    assert store.committed_steps() == [5]


def test_a_local_store_retires_a_step_over_the_trash_a_killed_deletion_left(tmp_path):
    store = LocalStore(tmp_path)
    stage(store, 4, {"shared.ckpt": b"x"}, tmp_path)
    store.commit(4, b'{"step": 4}')
    (tmp_path / ".old-step-000000004" / "half-deleted").mkdir(parents=True)  # a process killed while deleting it
    store.retire(4)
    assert store.committed_steps() == [] and not (tmp_path / ".old-step-000000004" / "half-deleted").exists()


def test_a_run_without_a_uri_keeps_its_checkpoints_in_its_run_dir(tmp_path):
    store = run_store(tmp_path / "checkpoints", None)
    assert isinstance(store, LocalStore) and store.root == tmp_path / "checkpoints"
