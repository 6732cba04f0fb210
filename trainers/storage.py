"""Where committed checkpoints live: a small protocol (`CheckpointStore`) with two
implementations, the local or shared file system (`LocalStore`: rename and fsync) and any fsspec
URL, S3 first (`ObjectStore`: `s3://bucket/prefix`, the endpoint and credentials from the
standard AWS variables, never from the run's config or logs).

Every piece of a save is written into a local staging directory first (trainers.tensorfile
writes files); `put` makes it durable in the store, `commit` publishes the step by writing its
marker last, after every piece, so a reader that finds the marker finds every piece the marker
names. An object store has no rename: a step's objects are written under their final names and
the marker object alone makes them a checkpoint; a save that fails midway leaves objects without
a marker, which `committed_steps` never lists and a later commit's pruning removes.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from trainers.layout import MARKER, STEP_PREFIX, step_dir_name

log = logging.getLogger("trainers.storage")
T = TypeVar("T")


class StoreError(OSError):
    """An operation of a checkpoint store that failed, after its retries where it has them."""


class CheckpointStore(Protocol):
    url: str  # where, in messages

    def put(self, step: int, name: str, staged: Path) -> None:
        """Piece `name` of step `step`'s save, staged locally at `staged`, made durable in the store."""
        ...

    def commit(self, step: int, marker: bytes) -> None:
        """Publish `step`: its marker written last, after every piece put."""
        ...

    def committed_steps(self) -> list[int]:
        """The steps whose marker exists, oldest first (the marker still to be verified)."""
        ...

    def read(self, step: int, name: str) -> bytes:
        """A small file of a step (its marker, a checksum file)."""
        ...

    def fetch(self, step: int, name: str) -> Path:
        """A local file holding piece `name` of `step` (the store's own file where it has one)."""
        ...

    def remove(self, step: int) -> None:
        """Every object or file of `step`, marker first (never a marker left naming missing pieces)."""
        ...


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's: the names in it, after a rename) by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """Checkpoints in a directory (local disk or a shared file system): the staging directory
    is `.tmp-step-N/` beside the steps, and `commit` renames it to `step-N/`, fsyncs, then writes
    the marker through a temporary name, fsync and rename."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def staging(self, step: int) -> Path:
        return self.root / f".tmp-{step_dir_name(step)}"

    def put(self, step: int, name: str, staged: Path) -> None:
        pass  # written and fsynced in place by the writer

    def commit(self, step: int, marker: bytes) -> None:
        tmp, final = self.staging(step), self.root / step_dir_name(step)
        if final.exists():  # a save of the same step after a restart: the new one wins
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.root)
        written = final / f".{MARKER}.tmp"
        with written.open("wb") as f:
            f.write(marker)
            f.flush()
            os.fsync(f.fileno())
        os.replace(written, final / MARKER)
        fsync_path(final)

    def committed_steps(self) -> list[int]:
        return sorted(int(d.name.removeprefix(STEP_PREFIX)) for d in self.root.glob(f"{STEP_PREFIX}*") if (d / MARKER).is_file())

    def read(self, step: int, name: str) -> bytes:
        return (self.root / step_dir_name(step) / name).read_bytes()

    def fetch(self, step: int, name: str) -> Path:
        return self.root / step_dir_name(step) / name

    def remove(self, step: int) -> None:
        directory = self.root / step_dir_name(step)
        (directory / MARKER).unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)


def transient(err: BaseException) -> bool:
    """An error a later attempt may not meet: a connection refused, reset or timed out, a server's
    5xx (fsspec raises them as OSError), botocore's connection errors."""
    if isinstance(err, FileNotFoundError | PermissionError):
        return False
    if isinstance(err, OSError):
        return True
    botocore = sys.modules.get("botocore.exceptions")  # imported by s3fs's client, when there is one
    return botocore is not None and isinstance(err, botocore.ConnectionError | botocore.HTTPClientError)


def retried(what: str, operation: Callable[[], T], attempts: int = 5, first_wait_s: float = 0.5) -> T:
    """`operation` tried up to `attempts` times, waiting twice as long after each failure (0.5,
    1, 2, 4 s): a store that errors or times out for a moment costs a few seconds, one that stays
    down fails the operation (a failed save: the previous checkpoint stays the newest)."""
    wait = first_wait_s
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except Exception as err:  # noqa: BLE001 - each library's own errors; told apart by transient()
            if not transient(err):  # no bucket, no key, no right, no credentials: no retry mends it
                raise StoreError(f"{what} failed: {type(err).__name__}: {err}") from err
            if attempt == attempts:
                raise StoreError(f"{what} failed after {attempts} attempts: {type(err).__name__}: {err}") from err
            log.warning("%s failed (attempt %d of %d, again in %.1f s): %s: %s", what, attempt, attempts, wait, type(err).__name__, err)
            time.sleep(wait)  # a backoff between attempts at a remote service, not a wait for a local event
            wait *= 2
    raise AssertionError("unreachable")


S3_OPTIONS: dict[str, Any] = {
    "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 10, "read_timeout": 120},
}


class ObjectStore:
    """Checkpoints under an fsspec URL (`s3://bucket/prefix`; any protocol fsspec knows):
    `<url>/step-N/<piece>`, `<url>/step-N/COMMITTED` written last. Pieces are staged in
    `staging_root` (local disk) and uploaded whole; fetched pieces are downloaded into it."""

    def __init__(self, url: str, staging_root: Path, attempts: int = 5, first_wait_s: float = 0.5) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.fs: Any
        # A client of its own (the endpoint and credentials read now, from the environment), and
        # `retried` the one retry policy: s3fs's and botocore's own retries, stacked under it,
        # turned a store gone for good into minutes of waiting (seen: 100 s for 3 attempts).
        options = S3_OPTIONS if self.url.startswith(("s3://", "s3a://")) else {}
        self.fs, self.prefix = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **options)
        if hasattr(self.fs, "retries"):
            self.fs.retries = 1  # s3fs's own attempts per call
        self.staging_root = staging_root
        self.attempts, self.first_wait_s = attempts, first_wait_s

    def key(self, step: int, name: str = "") -> str:
        return f"{self.prefix}/{step_dir_name(step)}" + (f"/{name}" if name else "")

    def staging(self, step: int) -> Path:
        return self.staging_root / f".tmp-{step_dir_name(step)}"

    def _retried(self, what: str, operation: Callable[[], T]) -> T:
        return retried(f"{what} ({self.url})", operation, self.attempts, self.first_wait_s)

    def put(self, step: int, name: str, staged: Path) -> None:
        self._retried(f"uploading {step_dir_name(step)}/{name}", lambda: self.fs.put_file(str(staged), self.key(step, name)))

    def commit(self, step: int, marker: bytes) -> None:
        self._retried(f"committing {step_dir_name(step)}", lambda: self.fs.pipe_file(self.key(step, MARKER), marker))
        shutil.rmtree(self.staging(step), ignore_errors=True)

    def committed_steps(self) -> list[int]:
        def listed() -> list[int]:
            self.fs.invalidate_cache(self.prefix)
            found = self.fs.glob(f"{self.prefix}/{STEP_PREFIX}*/{MARKER}")
            return sorted(int(Path(path).parent.name.removeprefix(STEP_PREFIX)) for path in found)

        return self._retried("listing checkpoints", listed)

    def read(self, step: int, name: str) -> bytes:
        return bytes(self._retried(f"reading {step_dir_name(step)}/{name}", lambda: self.fs.cat_file(self.key(step, name))))

    def fetch(self, step: int, name: str) -> Path:
        local = self.staging_root / "fetched" / step_dir_name(step) / name
        local.parent.mkdir(parents=True, exist_ok=True)
        self._retried(f"downloading {step_dir_name(step)}/{name}", lambda: self.fs.get_file(self.key(step, name), str(local)))
        return local

    def remove(self, step: int) -> None:
        def removed() -> None:
            if self.fs.exists(self.key(step, MARKER)):
                self.fs.rm_file(self.key(step, MARKER))
            for path in self.fs.find(self.key(step)):
                self.fs.rm_file(path)

        self._retried(f"removing {step_dir_name(step)}", removed)
        shutil.rmtree(self.staging_root / "fetched" / step_dir_name(step), ignore_errors=True)


def open_store(location: str, staging_root: Path) -> CheckpointStore:
    """A URL with a scheme (`s3://...`) is an object store; anything else a directory."""
    if "://" in location and not location.startswith("file://"):
        return ObjectStore(location, staging_root)
    return LocalStore(Path(location.removeprefix("file://")))
