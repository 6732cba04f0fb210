"""Atomic, verifiable checkpoints shared by all ranks of a job.

The layout under <run_dir>/checkpoints/ is trainers.layout's (step-NNNNNNNNN/ with shared.ckpt,
one rank-NNNNN.ckpt per rank, and the COMMITTED marker). A save writes into `.tmp-step-.../`, fsyncs every file, renames the directory, fsyncs the
parent, then writes COMMITTED (itself via a temporary file, fsync and rename). Only directories
whose COMMITTED marker matches their files are ever loaded; anything else is reported and
skipped in favour of the previous one. Files are in the pickle-free format of
`trainers.tensorfile` (tensor bytes written straight from memory, the small header read with
`torch.load(weights_only=True)`): nothing in them can run code. Writing happens on a
background thread (async, from reused host copies of the state) or inline (sync);
the commit waits until every rank has written, which the ranks agree on at a step boundary.
"""

from __future__ import annotations

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

from trainers.layout import BEST, MARKER, SHARED, STEP_PREFIX, rank_file, rank_files, read_best, step_dir_name
from trainers.storage import fsync_path
from trainers.tensorfile import read_tensor_file, write_tensor_file

log = logging.getLogger("trainers.checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used; the message names the cause."""


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
    path: Path
    world_size: int


def verify(directory: Path) -> Committed:
    """The checkpoint in `directory` if its marker and checksums hold, else CheckpointError."""
    marker = directory / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{directory.name} has no {MARKER} marker (an interrupted save)")
    try:
        meta = json.loads(marker.read_text())
        files: dict[str, dict[str, Any]] = meta["files"]
        step, world_size = int(meta["step"]), int(meta["world_size"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{directory.name}: unreadable {MARKER} marker ({err})") from None
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{directory.name}: {name} is missing")
        if path.stat().st_size != expected["bytes"] or sha256_of(path) != expected["sha256"]:
            raise CheckpointError(f"{directory.name}: {name} does not match its checksum (truncated or corrupted)")
    return Committed(step, directory, world_size)


class Checkpointer:
    """One per rank. `begin_save` writes this rank's part; `commit` (all ranks, after they agree
    that everybody finished writing) makes it visible. Rank 0 renames and marks."""

    def __init__(self, root: Path, rank: int, world_size: int, keep: int) -> None:
        if keep < 2:
            raise CheckpointError(f"keep={keep}: keep at least 2 checkpoints so a bad newest one has a fallback")
        self.root, self.rank, self.world_size, self.keep = root, rank, world_size, keep
        self._writer: threading.Thread | None = None
        self._host_copies = HostCopies()
        self._copied = threading.Event()  # the pending save's deferred copies are done
        self._copied.set()
        self._deleter: threading.Thread | None = None
        self._error: BaseException | None = None
        self.pending_step: int | None = None
        # Directories already checked, or committed by us: pruning after every save must not
        # re-read and re-hash every kept checkpoint. Loading always verifies afresh.
        self._verified: dict[Path, Committed] = {}
        self.best = read_best(root)  # the checkpoint kept for its validation figure (checkpoint.best), never pruned
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(f"checkpoint dir {root} cannot be created: {err.strerror}") from None
        if not os.access(root, os.W_OK):
            raise CheckpointError(f"checkpoint dir {root} is not writable")

    # --- saving -------------------------------------------------------------------------------

    def tmp_dir(self, step: int) -> Path:
        return self.root / f".tmp-{step_dir_name(step)}"

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
        tmp.mkdir(parents=True, exist_ok=True)  # every rank may create it: no ordering needed
        self.pending_step = step
        copied = self._copied = threading.Event()

        def write() -> None:
            try:
                for buffer, live in deferred:
                    buffer.copy_(live)
            except BaseException as err:  # reported on the training thread by wait_written()
                self._error = err
                return
            finally:
                copied.set()
            try:
                save_tensor_file(tmp / rank_file(self.rank), own)
                if shared is not None:
                    save_tensor_file(tmp / SHARED, shared)
            except BaseException as err:  # reported on the training thread by wait_written()
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
        """True when this rank's part of the pending save is on disk (or failed)."""
        return self._writer is None or not self._writer.is_alive()

    def wait_written(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            err, self._error = self._error, None
            self.pending_step = None
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise CheckpointError(f"writing the checkpoint failed: {reason}; the previous committed checkpoint is intact")

    def commit(self) -> Path | None:
        """Called on every rank once all ranks have written; rank 0 publishes the checkpoint."""
        step = self.pending_step
        self.pending_step = None
        if step is None or self.rank != 0:
            return None
        tmp, final = self.tmp_dir(step), self.root / step_dir_name(step)
        expected = {SHARED, *(rank_file(r) for r in range(self.world_size))}
        missing = sorted(name for name in expected if not (tmp / f"{name}.sum").is_file())
        if missing:
            raise CheckpointError(f"step {step}: files {missing} were not written")
        files = {name: json.loads((tmp / f"{name}.sum").read_text()) for name in sorted(expected)}
        if final.exists():  # a save of the same step after a restart: the new one wins
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.root)
        marker = {"step": step, "world_size": self.world_size, "files": files}
        write_durably(final / f".{MARKER}.tmp", lambda f: f.write(json.dumps(marker, indent=1).encode()))
        os.replace(final / f".{MARKER}.tmp", final / MARKER)
        fsync_path(final)
        self._verified[final] = Committed(step, final, self.world_size)  # we just wrote its sums
        self._prune(step)
        return final

    def _prune(self, committed_step: int) -> None:
        """Keep the newest `keep`. Old directories are renamed out of sight at once and deleted
        on a background thread: deleting a large checkpoint takes longer than writing a marker
        (measured: ~0.18 s for 256 MiB here), and the training thread must not wait for it."""
        self.wait_pruned()
        kept = sorted(self._checked_newest_first(self._verify_once), key=lambda c: c.step)
        doomed: list[Path] = []
        best = self.best["step"] if self.best else None
        for old in kept[: -self.keep]:
            if old.step == best:
                continue
            trash = self.root / f".old-{old.path.name}"
            if trash.exists():  # left by a process killed while deleting it
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(old.path, trash)
            self._verified.pop(old.path, None)
            doomed.append(trash)
        # Leftovers of interrupted saves are older than what was just committed; a newer
        # temporary dir belongs to a save other ranks have already begun: never touch it.
        doomed += [stale for stale in self.root.glob(f".tmp-{STEP_PREFIX}*") if int(stale.name.removeprefix(f".tmp-{STEP_PREFIX}")) < committed_step]
        doomed += [leftover for leftover in self.root.glob(f".old-{STEP_PREFIX}*") if leftover not in doomed]
        if doomed:

            def delete() -> None:
                for path in doomed:
                    shutil.rmtree(path, ignore_errors=True)

            self._deleter = threading.Thread(target=delete, name="checkpoint-prune", daemon=True)
            self._deleter.start()

    def mark_best(self, step: int, metric: str, value: float, mode: str) -> None:
        """Keep committed checkpoint `step` as the best by `metric` (rank 0 writes best.json; the
        one it named before is pruned with the old ones from the next commit on)."""
        record = {"step": step, "metric": metric, "value": value, "mode": mode, "path": step_dir_name(step)}
        if self.rank == 0:
            tmp = self.root / f".{BEST}.tmp"
            write_durably(tmp, lambda f: f.write(json.dumps(record, indent=1).encode()))
            os.replace(tmp, self.root / BEST)
            fsync_path(self.root)
        self.best = record

    def wait_pruned(self) -> None:
        """Wait until old checkpoints are deleted (call before exit)."""
        if self._deleter is not None:
            self._deleter.join()
            self._deleter = None

    # --- loading ------------------------------------------------------------------------------

    def _verify_once(self, directory: Path) -> Committed:
        if directory not in self._verified:
            self._verified[directory] = verify(directory)
        return self._verified[directory]

    def _checked_newest_first(self, check: Callable[[Path], Committed] = verify) -> Iterator[Committed]:
        """Valid checkpoints, newest first, each verified only when reached; invalid ones are
        reported and skipped. Step directories sort by name (zero-padded step numbers)."""
        for directory in sorted(self.root.glob(f"{STEP_PREFIX}*"), reverse=True):
            try:
                yield check(directory)
            except CheckpointError as err:
                log.warning("skipping checkpoint: %s", err)

    def committed(self) -> list[Committed]:
        """Valid checkpoints, oldest first; invalid ones are reported and skipped."""
        return sorted(self._checked_newest_first(), key=lambda c: c.step)

    def rank_states(self, step: int) -> Iterator[dict[str, Any]]:
        """Every rank's own file of committed checkpoint `step`, read one at a time (resharding)."""
        for path in rank_files(self.root / step_dir_name(step)):
            yield load_tensor_file(path)

    def load_step(self, step: int) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
        """Committed checkpoint `step`, as load_latest gives it; CheckpointError if it does not verify."""
        checkpoint = verify(self.root / step_dir_name(step))
        own = load_tensor_file(checkpoint.path / rank_file(self.rank)) if checkpoint.world_size == self.world_size else None
        return checkpoint.step, load_tensor_file(checkpoint.path / SHARED), own

    def load_latest(self) -> tuple[int, dict[str, Any], dict[str, Any] | None] | None:
        """(step, shared state, this rank's own state or None if the world size changed).
        Only the newest checkpoints are read, down to the first that verifies and loads."""
        for checkpoint in self._checked_newest_first():
            try:
                shared = load_tensor_file(checkpoint.path / SHARED)
                own_path = checkpoint.path / rank_file(self.rank)
                own = load_tensor_file(own_path) if checkpoint.world_size == self.world_size else None
            except CheckpointError as err:
                log.warning("skipping checkpoint: %s", err)
                continue
            return checkpoint.step, shared, own
        return None
