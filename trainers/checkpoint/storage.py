"""Where committed checkpoints live: a small protocol (`CheckpointStore`) with two
implementations, the local or shared file system (`LocalStore`: rename and fsync) and any fsspec
URL, S3 first (`ObjectStore`: `s3://bucket/prefix`, the endpoint and credentials from the
standard AWS variables, never from the run's config or logs).

Every piece of a save is written into a local staging directory first (trainers.checkpoint.tensorfile
writes files); `put` makes it durable in the store, `commit` publishes the step by writing its
marker last, after every piece, so a reader that finds the marker finds every piece the marker
names. An object store has no rename: a step's objects are written under their final names and
the marker object alone makes them a checkpoint; a save that fails midway leaves objects without
a marker, which `committed_steps` never lists and a later commit's pruning removes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from trainers.checkpoint.layout import MARKER, STEP_PREFIX, step_dir_name, step_number

log = logging.getLogger("trainers.checkpoint.storage")
T = TypeVar("T")


class StoreError(OSError):
    """An operation of a checkpoint store that failed, after its retries where it has them;
    `transient`: the store was unreachable or erring (a later start may find it back), not a
    missing bucket, key or right."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class CheckpointStore(Protocol):
    url: str  # where, in messages
    local: bool  # True: its files are read in place (a checksum costs no download)

    def staging(self, step: int) -> Path:
        """The local directory this rank writes step `step`'s pieces into before `put`."""
        ...

    def put(self, step: int, name: str, staged: Path) -> None:
        """Piece `name` of step `step`'s save, staged locally at `staged`, made durable in the store."""
        ...

    def read_staged(self, step: int, name: str) -> bytes | None:
        """A small piece put for `step`, not yet committed (a checksum file); None: not put."""
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

    def size(self, step: int, name: str) -> int | None:
        """The size of piece `name` of `step`; None: no such piece."""
        ...

    def fetch(self, step: int, name: str) -> Path:
        """A local file holding piece `name` of `step` (the store's own file where it has one)."""
        ...

    def release(self, path: Path) -> None:
        """Done with a file `fetch` gave: a downloaded copy is deleted."""
        ...

    def remove(self, step: int) -> None:
        """Every object or file of `step`, marker first (never a marker left naming missing pieces)."""
        ...

    def retire(self, step: int) -> None:
        """`step` out of sight at once (never listed again); `remove_leftovers` deletes the rest."""
        ...

    def remove_leftovers(self, before: int) -> None:
        """What retired steps, and interrupted saves of steps before `before`, left behind."""
        ...

    def write_meta(self, name: str, data: bytes) -> None:
        """A small file beside the steps (best.json), replaced whole."""
        ...

    def read_meta(self, name: str) -> bytes | None:
        """A file `write_meta` wrote; None: none."""
        ...


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's: the names in it, after a rename) by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_staged_before(root: Path, before: int) -> None:
    """The staging directories of saves before step `before` under `root`; a newer one belongs to
    a save other ranks have already begun: never touched."""
    for stale in root.glob(f".tmp-{STEP_PREFIX}*"):
        step = step_number(stale.name.removeprefix(".tmp-"))
        if step is not None and step < before:
            shutil.rmtree(stale, ignore_errors=True)


class LocalStore:
    """Checkpoints in a directory (local disk or a shared file system): the staging directory
    is `.tmp-step-N/` beside the steps, and `commit` renames it to `step-N/`, fsyncs, then writes
    the marker through a temporary name, fsync and rename."""

    local = True

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def staging(self, step: int) -> Path:
        return self.root / f".tmp-{step_dir_name(step)}"

    def put(self, step: int, name: str, staged: Path) -> None:
        pass  # written and fsynced in place by the writer

    def read_staged(self, step: int, name: str) -> bytes | None:
        try:
            return (self.staging(step) / name).read_bytes()
        except FileNotFoundError:
            return None

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
        return sorted(step for d in self.root.glob(f"{STEP_PREFIX}*") if (step := step_number(d.name)) is not None and (d / MARKER).is_file())

    def read(self, step: int, name: str) -> bytes:
        return (self.root / step_dir_name(step) / name).read_bytes()

    def size(self, step: int, name: str) -> int | None:
        path = self.root / step_dir_name(step) / name
        return path.stat().st_size if path.is_file() else None

    def fetch(self, step: int, name: str) -> Path:
        return self.root / step_dir_name(step) / name

    def release(self, path: Path) -> None:
        pass  # the store's own file

    def retire(self, step: int) -> None:
        """One rename: never half a step listed."""
        directory, trash = self.root / step_dir_name(step), self.root / f".old-{step_dir_name(step)}"
        if trash.exists():  # left by a process killed while deleting it
            shutil.rmtree(trash, ignore_errors=True)
        if directory.exists():
            os.replace(directory, trash)

    def remove(self, step: int) -> None:
        self.retire(step)
        shutil.rmtree(self.root / f".old-{step_dir_name(step)}", ignore_errors=True)

    def remove_leftovers(self, before: int) -> None:
        remove_staged_before(self.root, before)
        for leftover in self.root.glob(f".old-{STEP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def write_meta(self, name: str, data: bytes) -> None:
        tmp = self.root / f".{name}.tmp"
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / name)
        fsync_path(self.root)

    def read_meta(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None


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
                raise StoreError(f"{what} failed after {attempts} attempts: {type(err).__name__}: {err}", transient=True) from err
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

    local = False

    def __init__(self, url: str, staging_root: Path, attempts: int = 5, first_wait_s: float = 0.5) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.client = f"{os.getpid()}-{id(self):x}"  # its downloads' directory (fetch)
        self._held = 0  # copies fetched and not yet released: the directory goes with the last
        self._held_lock = threading.Lock()
        self.fs: Any
        # A client of its own (the endpoint and credentials read now, from the environment), and
        # `retried` the one retry policy: s3fs's and botocore's own retries, stacked under it,
        # turned a store gone for good into minutes of waiting (seen: 100 s for 3 attempts).
        options = S3_OPTIONS if self.url.startswith(("s3://", "s3a://")) else {}
        problem = unusable(self.url)
        if problem:
            raise StoreError(problem)
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
        staged.unlink(missing_ok=True)  # in the store now: the local disk keeps no copy

    def read_staged(self, step: int, name: str) -> bytes | None:
        return self._read_or_none(f"reading {step_dir_name(step)}/{name}", self.key(step, name))

    def _read_or_none(self, what: str, key: str) -> bytes | None:
        def read() -> bytes | None:
            try:
                return bytes(self.fs.cat_file(key))
            except FileNotFoundError:
                return None

        return self._retried(what, read)

    def commit(self, step: int, marker: bytes) -> None:
        self._retried(f"committing {step_dir_name(step)}", lambda: self.fs.pipe_file(self.key(step, MARKER), marker))
        shutil.rmtree(self.staging(step), ignore_errors=True)

    def committed_steps(self) -> list[int]:
        def listed() -> list[int]:
            self.fs.invalidate_cache(self.prefix)
            found = self.fs.glob(f"{self.prefix}/{STEP_PREFIX}*/{MARKER}")
            return sorted(step for path in found if (step := step_number(Path(path).parent.name)) is not None)

        return self._retried("listing checkpoints", listed)

    def read(self, step: int, name: str) -> bytes:
        return bytes(self._retried(f"reading {step_dir_name(step)}/{name}", lambda: self.fs.cat_file(self.key(step, name))))

    def size(self, step: int, name: str) -> int | None:
        def sized() -> int | None:
            try:
                return int(self.fs.info(self.key(step, name))["size"])
            except FileNotFoundError:
                return None

        return self._retried(f"reading the size of {step_dir_name(step)}/{name}", sized)

    def fetch(self, step: int, name: str) -> Path:
        # A directory of this client's own: the ranks of one machine share the run dir, and one
        # rank's release (its copy deleted) took the file another rank was still hashing.
        local = self.downloads / step_dir_name(step) / name
        with self._held_lock:
            self._held += 1
            local.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._retried(f"downloading {step_dir_name(step)}/{name}", lambda: self.fs.get_file(self.key(step, name), str(local)))
        except BaseException:
            self.release(local)
            raise
        return local

    @property
    def downloads(self) -> Path:
        return self.staging_root / "fetched" / self.client

    def remove(self, step: int) -> None:
        def removed() -> None:
            if self.fs.exists(self.key(step, MARKER)):
                self.fs.rm_file(self.key(step, MARKER))
            for path in self.fs.find(self.key(step)):
                self.fs.rm_file(path)

        self._retried(f"removing {step_dir_name(step)}", removed)
        for fetched in (self.staging_root / "fetched").glob(f"*/{step_dir_name(step)}"):
            shutil.rmtree(fetched, ignore_errors=True)

    def release(self, path: Path) -> None:
        path.unlink(missing_ok=True)  # a downloaded copy: a large model's second copy on local disk
        with self._held_lock:
            self._held -= 1
            if self._held == 0:  # nothing of ours is downloading or read: no empty directories left behind
                shutil.rmtree(self.downloads, ignore_errors=True)

    def retire(self, step: int) -> None:
        """Its marker deleted: one request; the pieces, unmarked now, go with the leftovers."""
        self._retried(f"retiring {step_dir_name(step)}", lambda: self.fs.rm_file(self.key(step, MARKER)) if self.fs.exists(self.key(step, MARKER)) else None)

    def remove_leftovers(self, before: int) -> None:
        def unmarked() -> list[int]:
            self.fs.invalidate_cache(self.prefix)
            steps = {step_number(Path(path).name) for path in self.fs.glob(f"{self.prefix}/{STEP_PREFIX}*")}
            return sorted(step for step in steps if step is not None and step < before and not self.fs.exists(self.key(step, MARKER)))

        for step in self._retried("listing leftovers", unmarked):
            self.remove(step)
        remove_staged_before(self.staging_root, before)

    def write_meta(self, name: str, data: bytes) -> None:
        self._retried(f"writing {name}", lambda: self.fs.pipe_file(f"{self.prefix}/{name}", data))

    def read_meta(self, name: str) -> bytes | None:
        return self._read_or_none(f"reading {name}", f"{self.prefix}/{name}")


def unusable(url: str) -> str | None:
    """Why fsspec cannot open `url` here (an unknown scheme, its package not installed); None: it can."""
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return f"{url}: fsspec knows no storage {protocol}:// (s3://bucket/prefix, gs://, az://, ... or a directory)"
    except ImportError as err:
        extra = " (pip install 'hpc-toolkit[storage]')" if protocol in ("s3", "s3a") else ""
        return f"{url}: the package for {protocol}:// is not installed{extra}: {err}"
    if not url.split("://", 1)[1].strip("/"):
        return f"{url}: name a bucket (and a prefix): {protocol}://bucket/prefix"
    return None


def is_object_url(location: str) -> bool:
    """A URL with a scheme other than file:// (`s3://...`): an object store; anything else a directory."""
    return "://" in location and not location.startswith("file://")


def open_store(location: str, staging_root: Path) -> CheckpointStore:
    """An object store for a URL with a scheme (`s3://...`), else a directory."""
    if is_object_url(location):
        return ObjectStore(location, staging_root)
    return LocalStore(Path(location.removeprefix("file://")))


# In <run_dir>/checkpoints/ when the run's checkpoints live elsewhere (checkpoint.uri): their URL,
# for the tools that find a run's checkpoints from its run dir (hpc.status, export, the supervisor).
POINTER = "STORE"


def run_location(uri: str, run_dir: Path) -> str:
    """The run's own place under `checkpoint.uri`: the run dir's name and a digest of its path, so
    two runs (a sweep's trials) never share one and every requeue of a run finds its own."""
    digest = hashlib.sha256(str(run_dir.absolute()).encode()).hexdigest()[:8]
    return f"{uri.rstrip('/')}/{run_dir.name}-{digest}"


def run_store(checkpoints: Path, uri: str | None) -> CheckpointStore:
    """The store of the run whose run dir holds `checkpoints/`: that directory itself, or the run's
    place under `uri`, named in checkpoints/STORE (the URL only: never an endpoint or a key)."""
    if not uri:
        return LocalStore(checkpoints)
    location = run_location(uri, checkpoints.parent)
    checkpoints.mkdir(parents=True, exist_ok=True)
    pointer = checkpoints / POINTER
    if not pointer.is_file() or pointer.read_text().strip() != location:
        written = checkpoints / f".{POINTER}.{os.getpid()}"  # every rank may write it: the same text
        written.write_text(location + "\n")
        os.replace(written, pointer)
    return open_store(location, checkpoints)


def stored_checkpoints(checkpoints: Path, attempts: int = 5) -> CheckpointStore:
    """A run's store as its run dir names it: `checkpoints/STORE`'s URL, else the directory."""
    try:
        location = (checkpoints / POINTER).read_text().strip()
    except FileNotFoundError:
        return LocalStore(checkpoints)
    store = open_store(location, checkpoints)
    if isinstance(store, ObjectStore):
        store.attempts = attempts
    return store


def newest_committed(checkpoints: Path, attempts: int = 1) -> int | None:
    """The newest committed step of the run whose checkpoints/ this is, wherever they live; None:
    none, or its object store unreachable now (warned: a login-node view, never an error)."""
    try:
        return max(stored_checkpoints(checkpoints, attempts).committed_steps(), default=None)
    except StoreError as err:
        log.warning("checkpoints of %s not listed: %s", checkpoints.parent, err)
        return None


def newest_committed_or_none(checkpoints: Path) -> int | None:
    """newest_committed for a line told either way (a fault's, a death's): a file system that
    cannot be read (the fault itself, often) says nothing rather than raise."""
    try:
        return newest_committed(checkpoints)
    except Exception:  # noqa: BLE001 - EIO, ESTALE, a damaged listing: the line goes without it
        return None
