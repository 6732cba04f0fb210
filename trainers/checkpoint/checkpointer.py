"""Atomic, verifiable checkpoints shared by all ranks of a job, in a checkpoint store
(trainers.checkpoint.storage: the run dir's checkpoints/, or an object store under checkpoint.uri).

The layout is trainers.checkpoint.layout's (step-NNNNNNNNN/ with shared.ckpt, one rank-NNNNN.ckpt per rank,
and the COMMITTED marker). Every rank writes and fsyncs its pieces into the store's staging
directory and puts them (an object store uploads them); rank 0 commits: the marker, naming the
size and sha256 of every piece, written last. Only steps whose marker matches their pieces are
ever loaded (an object store's pieces are hashed as they are fetched); anything else is reported
and skipped in favour of the previous one. Files are in the pickle-free format of
`trainers.checkpoint.tensorfile` (tensor bytes written straight from memory, the small header read with
`torch.load(weights_only=True)`): nothing in them can run code. Writing happens on a
background thread (async, from reused host copies of the state) or inline (sync);
the commit waits until every rank has written, which the ranks agree on at a step boundary.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainers.checkpoint.layout import BEST, MARKER, SHARED, parse_best, rank_file, step_dir_name
from trainers.checkpoint.memory import MemoryCopies
from trainers.checkpoint.storage import CheckpointStore, LocalStore, StoreError
from trainers.checkpoint.tensorfile import read_tensor_file, write_tensor_file
from trainers.faults import STORAGE_ERRNO

log = logging.getLogger("trainers.checkpoint.checkpointer")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used; the message names the cause."""


class StoreUnavailable(CheckpointError):
    """The checkpoint store stayed unreachable through every retry: unlike the other checkpoint
    errors, one a restart may not meet (hpc.rank.failures restarts the ranks)."""


def store_failure(what: str, err: StoreError) -> CheckpointError:
    error = StoreUnavailable if err.transient else CheckpointError
    return error(f"{what} failed: {err}; the previous committed checkpoint is intact")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_durably(path: Path, write: Callable[[Any], None]) -> None:
    """Write through `write(file)`, flush and fsync; a crash leaves the file absent or whole
    only when the caller renames afterwards (we always write into temporary names)."""
    with path.open("wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_tensor_file(path: Path, obj: Any) -> None:
    """Write and fsync `obj`, plus `<name>.sum` holding its size and sha256 for the commit."""
    nbytes, sha256 = write_tensor_file(path, obj)
    summary = {"bytes": nbytes, "sha256": sha256}
    write_durably(path.with_name(path.name + ".sum"), lambda f: f.write(json.dumps(summary).encode()))


def load_tensor_file(path: Path) -> Any:
    try:
        return read_tensor_file(path)
    except Exception as err:  # pickle.UnpicklingError for code-carrying headers, and many others
        raise CheckpointError(f"{path} cannot be loaded safely: {' '.join(str(err).split())[:200]}") from None


Deferred = list[tuple[torch.Tensor, torch.Tensor]]  # (host buffer, live tensor) still to copy


class HostCopies:
    """Host copies of the state for async saves, kept between saves: after the first one a
    snapshot is a copy into memory that is already allocated and mapped (no page faults). Costs
    one extra copy of the state in host memory (pinned for CUDA tensors, so the device-to-host
    copy runs at full speed)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def snapshot(self, obj: Any, key: tuple[Any, ...] = (), later: Callable[[torch.Tensor], bool] | None = None) -> tuple[Any, Deferred]:
        """A copy whose tensors training will not touch while a background thread writes them,
        and the (host buffer, live tensor) pairs left to copy: the CPU tensors `later` names,
        which the caller promises not to change until they are copied. Only safe to call
        once the previous save from these buffers has been written."""
        deferred: Deferred = []
        copy = self._copy(obj, key, later, deferred)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return copy, deferred

    def _copy(self, obj: Any, key: tuple[Any, ...], later: Callable[[torch.Tensor], bool] | None, deferred: Deferred) -> Any:
        if isinstance(obj, torch.Tensor):
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                buffer = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
                self._buffers[key] = buffer
            if later is not None and not obj.is_cuda and later(obj):
                deferred.append((buffer, obj.detach()))
                return buffer
            return buffer.copy_(obj.detach(), non_blocking=obj.is_cuda)
        if isinstance(obj, dict):
            return {name: self._copy(value, (*key, name), later, deferred) for name, value in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self._copy(value, (*key, i), later, deferred) for i, value in enumerate(obj))
        return obj


@dataclass(frozen=True)
class Committed:
    step: int
    world_size: int
    files: dict[str, dict[str, Any]]  # piece name: {"bytes", "sha256"}
    where: str  # the step's place in its store, for messages


def read_marker(store: CheckpointStore, step: int) -> tuple[int, dict[str, dict[str, Any]]]:
    """(world size, {piece: {"bytes", "sha256"}}) of committed step `step`'s marker; CheckpointError
    when it is missing, unreadable or names another step."""
    name = step_dir_name(step)
    try:
        meta = json.loads(store.read(step, MARKER))
        files: dict[str, dict[str, Any]] = meta["files"]
        world_size = int(meta["world_size"])
        if int(meta["step"]) != step:
            raise ValueError(f"it names step {meta['step']}")
    except FileNotFoundError:
        raise CheckpointError(f"{name} has no {MARKER} marker (an interrupted save)") from None
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{name}: unreadable {MARKER} marker ({err})") from None
    except StoreError as err:
        raise CheckpointError(f"{name}: {err}") from None
    return world_size, files


def verify(store: CheckpointStore, step: int) -> Committed:
    """Checkpoint `step` if its marker names pieces that are all there with their sizes (and, in
    a local store, their checksums: an object store's are checked as a piece is fetched), else
    CheckpointError."""
    name = step_dir_name(step)
    world_size, files = read_marker(store, step)
    for piece, expected in files.items():
        try:
            size = store.size(step, piece)
        except StoreError as err:
            raise CheckpointError(f"{name}: {err}") from None
        if size is None:
            raise CheckpointError(f"{name}: {piece} is missing")
        if size != expected["bytes"] or (store.local and sha256_of(store.fetch(step, piece)) != expected["sha256"]):
            raise CheckpointError(f"{name}: {piece} does not match its checksum (truncated or corrupted)")
    return Committed(step, world_size, files, f"{store.url}/{name}")


def load_piece(store: CheckpointStore, checkpoint: Committed, piece: str) -> Any:
    """Piece `piece` of a verified checkpoint, read safely; an object store's download is hashed
    against the marker first (CheckpointError when it does not match)."""
    try:
        path = store.fetch(checkpoint.step, piece)
    except StoreError as err:
        raise CheckpointError(f"{step_dir_name(checkpoint.step)}: {err}") from None
    try:
        if not store.local and sha256_of(path) != checkpoint.files[piece]["sha256"]:
            raise CheckpointError(f"{step_dir_name(checkpoint.step)}: {piece} does not match its checksum (truncated or corrupted)")
        return load_tensor_file(path)
    finally:
        store.release(path)


class Checkpointer:
    """One per rank. `begin_save` writes this rank's part; `commit` (all ranks, after they agree
    that everybody finished writing) makes it visible. Rank 0 commits."""

    def __init__(self, store: CheckpointStore | Path, rank: int, world_size: int, keep: int, memory: MemoryCopies | None = None) -> None:
        if keep < 2:
            raise CheckpointError(f"keep={keep}: keep at least 2 checkpoints so a bad newest one has a fallback")
        self.store = LocalStore(store) if isinstance(store, Path) else store
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.memory = memory  # the node's copies of the newest checkpoint (trainers.checkpoint.memory)
        self._writer: threading.Thread | None = None
        self._host_copies = HostCopies()
        self._copied = threading.Event()  # the pending save's deferred copies are done
        self._copied.set()
        self._deleter: threading.Thread | None = None
        self._error: BaseException | None = None
        self.pending_step: int | None = None
        # Steps already checked, or committed by us: pruning after every save must not re-read
        # and re-hash every kept checkpoint. Loading always verifies afresh.
        self._verified: dict[int, Committed] = {}
        staging = self.store.staging(0).parent
        try:
            staging.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(f"checkpoint dir {staging} cannot be created: {err.strerror}") from None
        if not os.access(staging, os.W_OK):
            raise CheckpointError(f"checkpoint dir {staging} is not writable")
        try:
            # the checkpoint kept for its validation figure (checkpoint.best), never pruned
            self.best = parse_best(self.store.read_meta(BEST))
        except StoreError as err:
            raise CheckpointError(f"the checkpoint store cannot be read: {err}") from None

    # --- saving -------------------------------------------------------------------------------

    def tmp_dir(self, step: int) -> Path:
        return self.store.staging(step)

    def begin_save(
        self, step: int, shared: dict[str, Any] | None, own: dict[str, Any], asynchronous: bool, later: Callable[[torch.Tensor], bool] | None = None
    ) -> None:
        """Write this rank's files for `step` (rank 0 also the shared state). An asynchronous
        save first copies the state, so training may go on changing the live tensors. The CPU
        tensors `later` names (parameters and optimizer state: only the optimizer step changes
        them) are copied by the writer thread instead, while training computes the next step;
        the caller must pass `fence()` before it changes them."""
        self.wait_written()
        deferred: Deferred = []
        if asynchronous:
            shared, deferred = self._host_copies.snapshot(shared, ("shared",), later)
            own, _ = self._host_copies.snapshot(own, ("own",))
        tmp = self.tmp_dir(step)
        self.pending_step = step
        try:
            tmp.mkdir(parents=True, exist_ok=True)  # every rank may create it: no ordering needed
        except OSError as err:  # a full or read-only disk: told at the save's handshake, on every rank alike
            self._error = err
            return
        copied = self._copied = threading.Event()
        pieces = [(rank_file(self.rank), own), *([(SHARED, shared)] if shared is not None else [])]
        # Copies in node memory serve a restart in this allocation; a synchronous save is mostly
        # the last before the job ends (a stop, the end of training): not worth its time.
        memory = self.memory if asynchronous else None

        def write() -> None:
            try:
                for buffer, live in deferred:
                    buffer.copy_(live)
            except BaseException as err:  # reported on the training thread by wait_written()
                self._error = err
                return
            finally:
                copied.set()
            name = ""
            try:
                for name, state in pieces:
                    save_tensor_file(tmp / name, state)
                    if memory is not None:
                        memory.hold(step, name, tmp / name)
                    self.store.put(step, name, tmp / name)
                    self.store.put(step, f"{name}.sum", tmp / f"{name}.sum")  # the checksum last: the piece is whole
            except BaseException as err:  # reported on the training thread by wait_written()
                if isinstance(err, OSError) and err.errno in STORAGE_ERRNO and err.filename is None:
                    err.filename = str(tmp / name)  # a write() or close() that failed names no file
                self._error = err

        if asynchronous:
            self._writer = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
            self._writer.start()
        else:
            write()

    def fence(self) -> float:
        """Block until the pending save holds its own copy of every tensor it deferred; seconds
        waited. Call before the optimizer step that follows an asynchronous save."""
        if self._copied.is_set():
            return 0.0
        started = time.perf_counter()
        self._copied.wait()
        return time.perf_counter() - started

    def written(self) -> bool:
        """True when this rank's part of the pending save is in the store (or failed)."""
        return self._writer is None or not self._writer.is_alive()

    def drop_pending(self, step: int | None = None) -> None:
        """The pending save (or that of `step`, whose error wait_written raised) abandoned on this
        rank: its writer joined, its error forgotten, its staging removed (every rank may remove
        it; only committed checkpoints are ever loaded)."""
        step = self.pending_step if step is None else step
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        self._error, self.pending_step = None, None
        if step is not None:
            shutil.rmtree(self.store.staging(step), ignore_errors=True)
            if self.memory is not None:
                self.memory.drop(step)

    def remove_uncommitted(self, step: int) -> None:
        """What a commit of `step` that failed midway left: its staging, and its directory where
        the marker never came (LocalStore renames first). Never loaded either way; not left."""
        shutil.rmtree(self.store.staging(step), ignore_errors=True)
        if step not in self.store.committed_steps():
            with contextlib.suppress(StoreError, OSError):
                self.store.remove(step)

    def wait_written(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            err, self._error = self._error, None
            self.pending_step = None
            if isinstance(err, StoreError):
                raise store_failure("writing the checkpoint", err)
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise CheckpointError(f"writing the checkpoint failed: {reason}; the previous committed checkpoint is intact") from err

    def commit(self) -> str | None:
        """Called on every rank once all ranks have written; rank 0 publishes the checkpoint."""
        step = self.pending_step
        self.pending_step = None
        if step is not None and self.memory is not None and step in self.memory.steps():
            self.memory.keep_only(step)  # a synchronous save (not copied) leaves the copies held as they are
        if step is None or self.rank != 0:
            return None
        expected = sorted({SHARED, *(rank_file(r) for r in range(self.world_size))})
        try:
            sums = {name: self.store.read_staged(step, f"{name}.sum") for name in expected}
            missing = [name for name, text in sums.items() if text is None]
            if missing:
                raise CheckpointError(f"step {step}: files {missing} were not written")
            files = {name: json.loads(text or b"") for name, text in sums.items()}
            marker = {"step": step, "world_size": self.world_size, "files": files}
            self.store.commit(step, json.dumps(marker, indent=1).encode())
        except StoreError as err:
            raise store_failure("committing the checkpoint", err) from None
        self._verified[step] = Committed(step, self.world_size, files, f"{self.store.url}/{step_dir_name(step)}")  # we just wrote its sums
        self._prune(step)
        return self._verified[step].where

    def _prune(self, committed_step: int) -> None:
        """Keep the newest `keep`. Old steps are retired at once (out of sight: a rename, or an
        object store's marker deleted) and deleted on a background thread: deleting a large
        checkpoint takes longer than writing a marker (measured: ~0.18 s for 256 MiB here), and
        the training thread must not wait for it."""
        self.wait_pruned()
        try:
            kept = sorted(self._checked_newest_first(self._verify_once), key=lambda c: c.step)
        except CheckpointError as err:  # the commit stands; pruning is tried again after the next one
            log.warning("pruning old checkpoints skipped: %s", err)
            return
        best = self.best["step"] if self.best else None
        store = self.store
        try:
            for old in kept[: -self.keep]:
                if old.step != best:
                    store.retire(old.step)
                    self._verified.pop(old.step, None)
        except StoreError as err:  # tried again after the next commit
            log.warning("pruning old checkpoints failed: %s", err)
            return

        def delete() -> None:
            try:
                # What retired steps and interrupted saves (older than the commit) left behind.
                store.remove_leftovers(committed_step)
            except StoreError as err:  # tried again after the next commit
                log.warning("deleting old checkpoints failed: %s", err)

        self._deleter = threading.Thread(target=delete, name="checkpoint-prune", daemon=True)
        self._deleter.start()

    def mark_best(self, step: int, metric: str, value: float, mode: str) -> None:
        """Keep committed checkpoint `step` as the best by `metric` (rank 0 writes best.json; the
        one it named before is pruned with the old ones from the next commit on)."""
        record = {"step": step, "metric": metric, "value": value, "mode": mode, "path": step_dir_name(step)}
        if self.rank == 0:
            try:
                self.store.write_meta(BEST, json.dumps(record, indent=1).encode())
            except StoreError as err:
                raise CheckpointError(f"recording the best checkpoint failed: {err}") from None
        self.best = record

    def wait_pruned(self) -> None:
        """Wait until old checkpoints are deleted (call before exit)."""
        if self._deleter is not None:
            self._deleter.join()
            self._deleter = None

    # --- loading ------------------------------------------------------------------------------

    def _verify_once(self, step: int) -> Committed:
        if step not in self._verified:
            self._verified[step] = verify(self.store, step)
        return self._verified[step]

    def _checked_newest_first(self, check: Callable[[int], Committed] | None = None) -> Iterator[Committed]:
        """Valid checkpoints, newest first, each verified only when reached; invalid ones are
        reported and skipped."""
        try:
            steps = self.store.committed_steps()
        except StoreError as err:
            raise store_failure("listing the checkpoints", err) from None
        for step in reversed(steps):
            try:
                yield (check or (lambda s: verify(self.store, s)))(step)
            except CheckpointError as err:
                log.warning("skipping checkpoint: %s", err)

    def committed(self) -> list[Committed]:
        """Valid checkpoints, oldest first; invalid ones are reported and skipped."""
        return sorted(self._checked_newest_first(), key=lambda c: c.step)

    def rank_states(self, step: int) -> Iterator[dict[str, Any]]:
        """Every rank's own file of committed checkpoint `step`, read one at a time (resharding)."""
        checkpoint = self._verify_once(step)
        for rank in range(checkpoint.world_size):
            yield load_piece(self.store, checkpoint, rank_file(rank))

    def _load(self, checkpoint: Committed) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
        shared = load_piece(self.store, checkpoint, SHARED)
        own = load_piece(self.store, checkpoint, rank_file(self.rank)) if checkpoint.world_size == self.world_size else None
        return checkpoint.step, shared, own

    def load_step(self, step: int) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
        """Committed checkpoint `step`, as load_latest gives it; CheckpointError if it does not verify."""
        return self._load(verify(self.store, step))

    def load_latest(self) -> tuple[int, dict[str, Any], dict[str, Any] | None] | None:
        """(step, shared state, this rank's own state or None if the world size changed).
        Only the newest checkpoints are read, down to the first that verifies and loads."""
        for checkpoint in self._checked_newest_first():
            try:
                return self._load(checkpoint)
            except CheckpointError as err:
                log.warning("skipping checkpoint: %s", err)
        return None
