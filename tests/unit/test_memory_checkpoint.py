"""The newest checkpoint in node memory (trainers.checkpoint.memory) and a restart's read of it
(trainers.checkpoint.restart): ranks as threads, each node a directory of its own. The real
thing, a node lost on the simulated Slurm with its ranks forked by the warm processes, is
tests/e2e/test_allocation_restart_slurm.py."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from collectives.testing import ThreadWorld
from hpc.env import MEMORY_VARIABLE as HPC_MEMORY_VARIABLE
from hpc.env import checkpoint_memory
from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.layout import SHARED, rank_file, step_dir_name
from trainers.checkpoint.memory import MEMORY_VARIABLE, MemoryCopies
from trainers.checkpoint.recovery import restore_newest
from trainers.checkpoint.restart import broadcast_bytes, load_held, share_own_copies
from trainers.checkpoint.saving import SaveCoordinator
from trainers.checkpoint.storage import LocalStore

WORLD = 2


@pytest.fixture(autouse=True)
def any_free_space_will_do(monkeypatch):
    """The tests' directories are on the disk, not a tmpfs: its free share is not the point here."""
    monkeypatch.setattr("trainers.checkpoint.memory.KEEP_FREE", 0.0)


def node_of(root: Path, rank: int, store: LocalStore) -> MemoryCopies:
    (root / f"node{rank}").mkdir(parents=True, exist_ok=True)  # the warm process's (hpc.rank.warm.node_memory)
    return MemoryCopies(root / f"node{rank}", store.url)


def saved(
    tmp_path: Path, steps: tuple[int, ...] = (2, 4), asynchronous: bool = True, salt: int = 0, peers: bool = False
) -> tuple[LocalStore, list[MemoryCopies]]:
    """Two ranks on two nodes saved `steps`: each step's shared state is its step number, each
    rank's own state [rank, step, salt]."""
    store = LocalStore(tmp_path / "checkpoints")
    memories = [node_of(tmp_path / "shm", rank, store) for rank in range(WORLD)]
    checkpointers = [Checkpointer(store, rank, WORLD, keep=2, memory=memories[rank]) for rank in range(WORLD)]
    for step in steps:
        for rank, ckpt in enumerate(checkpointers):
            shared = {"w": torch.full((64,), float(step))} if rank == 0 else None
            ckpt.begin_save(step, shared, {"rank": torch.tensor([rank, step, salt])}, asynchronous=asynchronous)
        for ckpt in checkpointers:
            ckpt.wait_written()
        for ckpt in reversed(checkpointers):  # rank 0's commit last: the others keep only the step first
            ckpt.commit()
        if peers:
            ThreadWorld(WORLD).run(lambda comm: share_own_copies(checkpointers[comm.rank], comm, step))  # noqa: B023 - run before the loop goes on
    return store, memories


class FarStore(LocalStore):
    """A store read as an object store is (`local` False: its pieces are fetched, not read in place)."""

    local = False


def restarted(store: LocalStore, memories: list[MemoryCopies | None]) -> list[tuple[int, dict, dict] | None]:
    return ThreadWorld(WORLD).run(lambda comm: load_held(Checkpointer(store, comm.rank, WORLD, keep=2, memory=memories[comm.rank]), comm))


def test_an_asynchronous_save_leaves_the_newest_committed_step_in_each_node_s_memory(tmp_path):
    store, memories = saved(tmp_path)
    assert [m.steps() for m in memories] == [[4], [4]]
    assert sorted(p.name for p in (memories[0].root / step_dir_name(4)).glob("*.ckpt")) == sorted([rank_file(0), SHARED])
    assert [p.name for p in (memories[1].root / step_dir_name(4)).glob("*.ckpt")] == [rank_file(1)]
    # a synchronous save (a stop's, the last one) is not copied: the job ends after it
    _, synchronous = saved(tmp_path / "sync", asynchronous=False)
    assert [m.steps() for m in synchronous] == [[], []]


@pytest.mark.parametrize(("far", "shared_from"), [(False, "store"), (True, "rank 0")], ids=["directory", "object-store"])
def test_a_restart_reads_every_piece_it_can_from_memory_and_restores_the_committed_state(tmp_path, caplog, far, shared_from):
    store, memories = saved(tmp_path)
    (store.root / step_dir_name(4) / rank_file(1)).write_bytes(b"not read: memory holds it")
    with caplog.at_level(logging.INFO, "trainers.checkpoint.restart"):
        results = restarted(FarStore(store.root) if far else store, memories)
    for rank, result in enumerate(results):
        assert result is not None
        step, shared, own = result
        assert step == 4 and torch.equal(shared["w"], torch.full((64,), 4.0)) and own["rank"].tolist() == [rank, 4, 0]
    assert "own file from memory, shared file from memory" in caplog.text  # rank 0
    # rank 1: the shared file read from a directory, or sent by rank 0 in place of a download
    assert f"own file from memory, shared file from {shared_from}" in caplog.text


@pytest.mark.parametrize("far", [False, True], ids=["directory", "object-store"])
def test_a_rank_on_a_new_node_reads_its_own_file_from_the_store_without_a_peer_copy(tmp_path, caplog, far):
    store, memories = saved(tmp_path)
    spare = node_of(tmp_path / "shm", 7, store)
    with caplog.at_level(logging.INFO, "trainers.checkpoint.restart"):
        results = restarted(FarStore(store.root) if far else store, [memories[0], spare])
    assert all(r is not None and r[0] == 4 for r in results)
    assert results[1] is not None and results[1][2]["rank"].tolist() == [1, 4, 0]
    assert f"own file from store, shared file from {'rank 0' if far else 'store'}" in caplog.text
    # a file sent is held on the new node from then on (written by a thread of its own: polled)
    held = spare.root / step_dir_name(4) / f"{SHARED}.sum"
    deadline = time.monotonic() + 30
    while far and not held.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.exists() == far


def test_every_node_holds_every_rank_s_small_own_file_so_a_lost_node_s_rank_gets_it_from_a_peer(tmp_path, caplog):
    store, memories = saved(tmp_path, peers=True)
    for memory in memories:  # each node: its ranks' own files and the other node's
        assert sorted(p.name for p in (memory.root / step_dir_name(4)).glob("rank-*.ckpt")) == [rank_file(0), rank_file(1)]
    (store.root / step_dir_name(4) / rank_file(1)).unlink()  # not read: a peer holds it
    spare = node_of(tmp_path / "shm", 7, store)
    with caplog.at_level(logging.INFO, "trainers.checkpoint.restart"):
        results = restarted(store, [memories[0], spare])
    assert results[1] is not None and results[1][2]["rank"].tolist() == [1, 4, 0]
    assert "own file from rank 0, shared file from store" in caplog.text


def test_own_files_too_large_for_every_node_stay_on_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr("trainers.checkpoint.restart.PEER_LIMIT", 100)  # sharded state's own files
    _, memories = saved(tmp_path, peers=True)
    assert [[p.name for p in (m.root / step_dir_name(4)).glob("rank-*.ckpt")] for m in memories] == [[rank_file(0)], [rank_file(1)]]


def test_a_copy_of_another_save_of_the_step_or_one_cut_short_is_never_used(tmp_path):
    store, memories = saved(tmp_path)
    held = memories[1].root / step_dir_name(4) / rank_file(1)
    other = saved(tmp_path / "other", steps=(4,), salt=1)[1][1].root / step_dir_name(4)  # step 4 saved again: another sum
    shutil.copyfile(other / rank_file(1), held)
    shutil.copyfile(other / f"{rank_file(1)}.sum", held.with_name(f"{rank_file(1)}.sum"))
    shared = memories[0].root / step_dir_name(4) / SHARED
    shared.write_bytes(shared.read_bytes()[:-8])  # cut short: its recorded sum is still the marker's
    results = restarted(store, memories)
    assert results[1] is not None and results[1][2]["rank"].tolist() == [1, 4, 0]  # the store's file instead
    assert torch.equal(results[0][1]["w"], torch.full((64,), 4.0))  # and the store's shared file


def test_no_copy_anywhere_or_a_piece_nobody_can_get_sends_every_rank_to_the_store_s_path(tmp_path):
    store, memories = saved(tmp_path)
    assert restarted(store, [None, None]) == [None, None]  # no memory: the store's path (load_latest)
    (tmp_path / "copied").mkdir()
    for name in (SHARED, f"{SHARED}.sum"):
        shutil.copyfile(memories[0].root / step_dir_name(4) / name, tmp_path / "copied" / name)
    for memory in memories:
        memory.drop(4)
    (store.root / step_dir_name(4) / rank_file(1)).unlink()
    memories[0].hold(4, SHARED, tmp_path / "copied" / SHARED)
    # rank 1 can get its own file nowhere: no rank restores alone
    assert restarted(store, memories) == [None, None]


def test_the_restore_falls_back_to_the_store_which_skips_a_broken_newest_step(tmp_path):
    store, memories = saved(tmp_path)
    for memory in memories:
        memory.drop(4)
    (store.root / step_dir_name(4) / SHARED).write_bytes(b"broken")

    def restore(comm):
        coordinator = SaveCoordinator(Checkpointer(store, comm.rank, WORLD, keep=2, memory=memories[comm.rank]), comm, None)  # type: ignore[arg-type]
        loaded = {}

        class Registry:
            def load(self, step, shared, own, ranks):
                loaded.update(step=step, w=shared["w"][0].item())

        restore_newest(coordinator, comm, Registry(), "t")  # type: ignore[arg-type]
        return loaded

    import trainers.checkpoint.recovery as recovery

    original = recovery.restore_checkpoint
    recovery.restore_checkpoint = lambda registry, step, shared, own, ranks, task: registry.load(step, shared, own, ranks)
    try:
        assert ThreadWorld(WORLD).run(restore) == [{"step": 2, "w": 2.0}] * WORLD
    finally:
        recovery.restore_checkpoint = original


@pytest.mark.parametrize("size", [0, 1, 7, 8, 4099])
def test_bytes_cross_a_broadcast_bit_for_bit_whatever_their_length(size, monkeypatch):
    monkeypatch.setattr("trainers.checkpoint.restart.CHUNK_BYTES", 1024)  # several parts
    data = bytes((i * 37 + 11) % 256 for i in range(size))
    got = ThreadWorld(3).run(lambda comm: broadcast_bytes(comm, data if comm.rank == 1 else None, root=1))
    assert got == [data] * 3


def test_a_full_memory_costs_the_copy_only_and_says_so_once(tmp_path, caplog):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the directory would go")
    memory = MemoryCopies(blocked, "store")
    source = tmp_path / "piece"
    source.write_bytes(b"x")
    with caplog.at_level(logging.WARNING, "trainers.checkpoint.memory"):
        memory.hold(1, "a", source)
        memory.hold(1, "b", source)
    assert caplog.text.count("copy in node memory") == 1 and memory.steps() == []


def test_a_copy_that_would_leave_the_tmpfs_under_half_free_is_not_made(tmp_path, monkeypatch, caplog):
    memory = MemoryCopies(tmp_path, "store")
    source = tmp_path / "piece"
    source.write_bytes(b"x" * 4096)
    (tmp_path / "piece.sum").write_text('{"bytes": 4096, "sha256": "0"}')
    monkeypatch.setattr("trainers.checkpoint.memory.KEEP_FREE", 1.0)  # no room left at any size
    with caplog.at_level(logging.WARNING, "trainers.checkpoint.memory"):
        memory.hold(1, "a", source)
    assert "tmpfs free" in caplog.text and memory.steps() in ([], [1]) and not list(memory.root.rglob("a"))
    monkeypatch.setattr("trainers.checkpoint.memory.KEEP_FREE", 0.0)
    memory.hold(1, "a", source)
    assert (memory.root / step_dir_name(1) / "a").read_bytes() == source.read_bytes()


def test_the_node_directory_is_named_for_user_job_and_node_and_the_variable_is_read(tmp_path, monkeypatch):
    root = checkpoint_memory("123_4", "../x", base=tmp_path)
    assert root.parent == checkpoint_memory("123_4", base=tmp_path) and root.parent.parent.parent == tmp_path
    assert root.name == "_x" and root.parent.name == "123_4"  # never a path out of the job's directory
    assert MEMORY_VARIABLE == HPC_MEMORY_VARIABLE  # trainers cannot import hpc: one name, said twice
    monkeypatch.delenv(MEMORY_VARIABLE, raising=False)
    assert MemoryCopies.from_env("s") is None
    monkeypatch.setenv(MEMORY_VARIABLE, str(tmp_path))
    copies = MemoryCopies.from_env("s")
    assert copies is not None and copies.root.parent == tmp_path


def test_a_synchronous_save_leaves_the_copies_held_as_they_are(tmp_path):
    store, memories = saved(tmp_path)
    ckpt = Checkpointer(store, 1, WORLD, keep=2, memory=memories[1])
    ckpt.begin_save(6, None, {"rank": torch.tensor([1, 6, 0])}, asynchronous=False)  # a best-validation save mid-run
    ckpt.wait_written()
    ckpt.commit()
    assert memories[1].steps() == [4]


def test_the_memory_directory_is_taken_only_when_it_is_private(tmp_path, monkeypatch):
    from hpc.env import private_dir
    from hpc.rank import warm

    assert warm.node_memory({}) is None  # a local run: never restarted in place
    monkeypatch.setattr(warm, "job_id", lambda env: "name")
    monkeypatch.setattr(warm, "checkpoint_memory", lambda job, node: tmp_path / "shm" / "hpctk-0" / job / node)
    (tmp_path / "shm").mkdir()
    made = warm.node_memory({})
    assert made is not None and all(private_dir(level) for level in (made, made.parent, made.parent.parent))
    shared = tmp_path / "shm" / "hpctk-0" / "name"
    shared.chmod(0o777)  # as another user's planted directory would be
    assert warm.node_memory({}) is None
    shared.chmod(0o700)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    shutil.rmtree(made)
    made.symlink_to(target)  # a link is never followed
    assert warm.node_memory({}) is None and not private_dir(made)


def test_the_job_s_memory_limit_is_read_from_its_cgroup_and_kept_half_free(tmp_path, monkeypatch):
    from trainers.checkpoint import memory

    proc = tmp_path / "cgroup"
    proc.write_text("0::/job_7/step_0\n")
    group = tmp_path / "fs" / "job_7" / "step_0"
    group.mkdir(parents=True)
    (group / "memory.max").write_text("1000\n")
    (group / "memory.current").write_text("300\n")
    assert memory.cgroup_memory(proc, tmp_path / "fs") == (1000, 300)
    (group / "memory.max").write_text("max\n")
    assert memory.cgroup_memory(proc, tmp_path / "fs") == (None, 300)
    assert memory.cgroup_memory(tmp_path / "absent", tmp_path / "fs") == (None, None)
    monkeypatch.setattr(memory, "cgroup_memory", lambda: (1000, 300))
    monkeypatch.setattr(memory, "KEEP_FREE", 0.5)
    monkeypatch.setattr(memory.os, "statvfs", lambda path: SimpleNamespace(f_bavail=1 << 30, f_frsize=1, f_blocks=1 << 30))  # an empty tmpfs
    assert memory.room_short(tmp_path, 200) is None
    assert "of the job's memory limit (0 MiB) free" in (memory.room_short(tmp_path, 201) or "")
