"""A restart's read of the newest checkpoint from the nodes' memory (trainers.checkpoint.memory),
with the store for what no node holds; every rank takes part (it is collective).

The store still decides which checkpoint: the newest committed step in it (the same on every
rank, or this path is not taken), whose marker names each piece's size and sha256. Each rank takes
its own file from its node's copy when the copy's recorded sum and size are the marker's, else
from the store (hashed as it is read).
A spare's ranks get their own files from a node that holds every rank's (small ones: replicated
training's), sent over the collectives. The shared file is held on rank 0's old node only: the
ranks of other nodes read it from a directory store (its page cache beat a broadcast, measured),
or, from an object store, get it from a rank that holds it over the collectives (one download
instead of one per rank). Any rank that cannot get a piece this way sends every rank back to the
store's path (`Checkpointer.load_latest`, which verifies everything and falls back to older
checkpoints): no rank ever restores alone.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import Any

import torch

from collectives.base import Collectives
from trainers.checkpoint.checkpointer import Checkpointer, CheckpointError, read_marker, sha256_of
from trainers.checkpoint.layout import SHARED, rank_file
from trainers.checkpoint.storage import StoreError
from trainers.checkpoint.tensorfile import read_tensor_bytes, read_tensor_file

log = logging.getLogger("trainers.checkpoint.restart")

CHUNK_BYTES = 64 << 20  # a broadcast's piece: the shared file is sent in parts, not one buffer
PEER_LIMIT = 64 << 20  # bytes: every rank's own file held on every node only up to this in all
BROADCAST_LIMIT = 1 << 30  # bytes: a shared file sent from a holder rather than downloaded by each rank, up to this


def load_held(checkpointer: Checkpointer, comm: Collectives) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
    """(step, shared state, own state) of the newest committed checkpoint, read from the nodes'
    memory where it is held there; None (on every rank alike) when no node holds it, the ranks
    disagree on the newest step, the world size changed, or any rank missed a piece."""
    memory = checkpointer.memory
    try:
        steps = checkpointer.store.committed_steps()
    except StoreError:
        steps = []
    newest = steps[-1] if steps else -1
    held = memory is not None and newest in memory.steps()
    seen = torch.tensor([newest, -newest, 1.0 if held else 0.0], dtype=torch.float64)
    comm.allreduce_(seen, op="max")
    if seen[0] != -seen[1] or newest < 0 or seen[2] == 0:
        return None
    files = _marker_files(checkpointer, newest, comm.world_size)
    find = functools.partial(_find, checkpointer, newest, files)
    mine, shared_here = find(rank_file(comm.rank)), find(SHARED)
    holds_all = bool(files) and all(find(rank_file(r)) is not None for r in range(comm.world_size))
    votes = comm.allgather(torch.tensor([bool(files), mine is not None, shared_here is not None, holds_all], dtype=torch.float64)).view(-1, 4)
    if bool((votes[:, 0] == 0).any()):
        return None
    own, own_from = _own_state(checkpointer, comm, newest, files, mine, votes)
    shared, shared_from = _piece_state(checkpointer, comm, newest, files, SHARED, shared_here, votes[:, 2])
    ok = torch.tensor([1.0 if shared is not None and own is not None else 0.0], dtype=torch.float64)
    comm.allreduce_(ok, op="min")
    if ok[0] == 0 or shared is None or own is None:
        return None
    log.info("checkpoint step %d read back from node memory where held: own file from %s, shared file from %s", newest, own_from, shared_from)
    return newest, shared, own


def _find(checkpointer: Checkpointer, step: int, files: dict[str, dict[str, Any]], name: str) -> Path | None:
    memory = checkpointer.memory
    return memory.find(step, name, files[name]) if memory is not None and name in files else None


def _marker_files(checkpointer: Checkpointer, step: int, world_size: int) -> dict[str, dict[str, Any]]:
    """The pieces step `step`'s marker names ({} when it cannot be read or names another world)."""
    try:
        saved_world, files = read_marker(checkpointer.store, step)
    except (CheckpointError, OSError):
        return {}
    named = {SHARED, *(rank_file(r) for r in range(world_size))}
    whole = isinstance(files, dict) and all(isinstance(files.get(n), dict) and {"bytes", "sha256"} <= set(files[n]) for n in named)
    return files if saved_world == world_size and whole else {}


def _parsed(piece: Path | bytes | memoryview) -> dict[str, Any] | None:
    """A piece's state; None when it does not parse (never an exception inside the collective
    protocol: a rank that raised would leave the others waiting in its next collective)."""
    try:
        return read_tensor_file(piece) if isinstance(piece, Path) else read_tensor_bytes(piece)
    except Exception as err:  # noqa: BLE001 - said, and the store's path decides instead
        log.warning("a checkpoint piece held in memory did not load: %s", err)
        return None


def _from_store(checkpointer: Checkpointer, step: int, name: str, sha256: str) -> dict[str, Any] | None:
    """Piece `name` from the store, hashed as it is read (its file read twice: the second time from the page cache)."""
    store = checkpointer.store
    try:
        path = store.fetch(step, name)
    except (StoreError, OSError):
        return None
    try:
        return _parsed(path) if sha256_of(path) == sha256 else None
    except OSError:  # gone, unreadable
        return None
    finally:
        store.release(path)


def _own_state(
    checkpointer: Checkpointer, comm: Collectives, step: int, files: dict[str, dict[str, Any]], mine: Path | None, votes: torch.Tensor
) -> tuple[dict[str, Any] | None, str]:
    """This rank's own file: its node's copy; for a rank whose node holds none (a spare), a node
    holding every rank's copy sends it (each lacking rank's in turn, every rank taking part);
    with no such node, the store's."""
    holders = torch.nonzero(votes[:, 3] > 0).flatten().tolist()
    sent: dict[str, Any] | None = None
    root = holders[0] if holders else None
    for lacking in torch.nonzero(votes[:, 1] == 0).flatten().tolist():
        if root is not None:
            got = _sent(checkpointer, comm, step, files, rank_file(lacking), _find(checkpointer, step, files, rank_file(lacking)), root)
            sent = got if lacking == comm.rank else sent
    if mine is not None:
        return _parsed(mine), "memory"
    if sent is not None:
        return sent, f"rank {root}"
    return _from_store(checkpointer, step, rank_file(checkpointer.rank), files[rank_file(checkpointer.rank)]["sha256"]), "store"


def _piece_state(
    checkpointer: Checkpointer, comm: Collectives, step: int, files: dict[str, dict[str, Any]], name: str, mine: Path | None, holding: torch.Tensor
) -> tuple[dict[str, Any] | None, str]:
    """A piece every rank needs (the shared file): this rank's node's copy; else, from an object
    store, the first holder's (every rank takes part in the broadcast when any lacks it: one
    download instead of one per rank); else the store's. A directory store is read, hashed:
    measured on one machine (docs/benchmarks.md), its page cache beat a broadcast of the file."""
    some_lack, some_hold = bool((holding == 0).any()), bool((holding > 0).any())
    # the same on every rank; every rank takes a buffer of the file's size: large ones are downloaded by each
    if some_lack and some_hold and not checkpointer.store.local and int(files[name]["bytes"]) <= BROADCAST_LIMIT:
        root = int(torch.nonzero(holding > 0)[0])
        sent = _sent(checkpointer, comm, step, files, name, mine, root)
        if mine is None:
            return sent, f"rank {root}"
    if mine is not None:
        return _parsed(mine), "memory"
    return _from_store(checkpointer, step, name, files[name]["sha256"]), "store"


def _sent(
    checkpointer: Checkpointer, comm: Collectives, step: int, files: dict[str, dict[str, Any]], name: str, held: Path | None, root: int
) -> dict[str, Any] | None:
    """Piece `name` broadcast from rank `root`'s copy (`held` there), parsed on every rank that
    holds none (and held there from now on: the next restart sends nothing); None on the others,
    or when it did not arrive whole."""
    try:
        data = held.read_bytes() if comm.rank == root and held is not None else None
    except OSError:
        data = b""  # sent all the same (the others wait for it): its size fails on every rank
    sent = broadcast_bytes(comm, data, root)
    if held is not None or len(sent) != int(files[name]["bytes"]):
        return None
    if checkpointer.memory is not None:
        threading.Thread(target=checkpointer.memory.hold_bytes, args=(step, name, sent, files[name]["sha256"]), daemon=True).start()
    return _parsed(sent)


def share_own_copies(checkpointer: Checkpointer, comm: Collectives, step: int) -> None:
    """After the commit of `step` (every rank, collective): every node holds every rank's own
    file in memory too, so the ranks of a lost node get theirs from a peer on a spare. Only while
    every rank holds its own copy and they are small (the RNG states and data position of
    replicated training: PEER_LIMIT); sharded state's large own files stay on their node (their
    sizes are compared first: nothing is read of them)."""
    memory = checkpointer.memory
    size = memory.size(step, rank_file(comm.rank)) if memory is not None else None
    sizes = comm.allgather(torch.tensor([float(size) if size is not None else -1.0], dtype=torch.float64))
    largest = int(sizes.max())
    if memory is None or bool((sizes < 0).any()) or largest * comm.world_size > PEER_LIMIT:
        return
    mine = memory.read(step, rank_file(comm.rank)) or b""  # gone since: sent empty, and not held by the others
    words = -(-largest // 8)
    buffer = bytearray(words * 8)
    buffer[: min(len(mine), len(buffer))] = mine[: len(buffer)]
    everyone = comm.allgather(torch.frombuffer(buffer, dtype=torch.float64) if words else torch.empty(0, dtype=torch.float64))
    if not memory.claim(step, "peers"):  # one rank of each node writes them
        return
    raw = memoryview(everyone.view(torch.uint8).numpy().tobytes())  # small: PEER_LIMIT
    for rank in range(comm.world_size):
        if rank != comm.rank:
            start = rank * words * 8
            memory.hold_bytes(step, rank_file(rank), raw[start : start + int(sizes[rank])], None)


def broadcast_bytes(comm: Collectives, data: bytes | None, root: int) -> memoryview:
    """Root's `data` on every rank (the others pass None), sent as float64 words in parts of
    CHUNK_BYTES: a broadcast copies bits, whatever their dtype says."""
    size = torch.tensor([float(len(data)) if data is not None else 0.0], dtype=torch.float64)
    comm.broadcast_(size, root)
    nbytes = int(size[0])
    padded = nbytes + (-nbytes % 8)
    buffer = bytearray(padded)
    if data is not None:
        buffer[:nbytes] = data
    words = torch.frombuffer(buffer, dtype=torch.float64) if padded else torch.empty(0, dtype=torch.float64)
    per_chunk = CHUNK_BYTES // 8
    for start in range(0, words.numel(), per_chunk):
        part = words[start : start + per_chunk]  # a contiguous view: the broadcast fills it in place
        comm.broadcast_(part, root)
    return memoryview(buffer)[:nbytes]
