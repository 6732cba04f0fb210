"""A rank's writes the file system refuses: full, over quota, read-only, failing or gone.

Such a write never raises where it happens (a line of steps.jsonl, a checkpoint piece, a log
line): the fault is noted once (`FAULTS`, one per process, as the stop flag is one per process)
and rides on the next step boundary's vote, where every rank learns of it at the same step and
ends alike (`StorageFailure`, raised on every rank): no rank waits in a collective for one that
left, nothing aborts the job, and the user reads one line that names the error, the path, the
file system's free space and what to do. Faults that may pass by themselves (EIO, ESTALE) end
the run too: a rank that cannot write cannot save, and every step trained after that is at risk.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# errno -> (what it is in words, what the user does about it)
STORAGE_ERRNO: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free some of your quota (or raise it)"),
    errno.EROFS: ("read-only file system", "make the file system writable again"),
    errno.EIO: ("I/O error", "check the file system (its device or server)"),
    errno.ESTALE: ("stale file handle (the shared file system went away)", "check that the shared file system is mounted"),
}
# These stay until someone acts (frees space, remounts): a restart or requeue would meet them
# again, so the job is neither (hpc.rank.failures). EIO and ESTALE may pass: counted as failures.
LASTING_STORAGE_ERRNO = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
# "disk full" for hpc.status: the words a user scanning fifty runs looks for
REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
    errno.ESTALE: "file system gone",
}


def storage_error(err: BaseException | None) -> OSError | None:
    """The OSError with a storage errno in `err` or what caused it (a CheckpointError wraps one)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in STORAGE_ERRNO:
            return err
        err = err.__cause__ or err.__context__
    return None


def size_text(count: float) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1: 0 B, 512 KiB, 23.9 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" or count >= 100 or count == int(count) else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def mount_point(path: Path) -> Path:
    """The mount point of the file system `path` is on (or would be on: its nearest existing parent)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def space_text(path: Path) -> str:
    """`0 B free of 24 MiB` for the file system of `path`; "" when it cannot be asked (gone)."""
    try:
        found = os.statvfs(mount_point(path))
    except OSError:
        return ""
    return f"{size_text(found.f_bavail * found.f_frsize)} free of {size_text(found.f_blocks * found.f_frsize)}"


@dataclass(frozen=True)
class Fault:
    """One refused write: its errno and the file (or directory) written."""

    errno: int
    path: str

    @property
    def words(self) -> str:
        return STORAGE_ERRNO[self.errno][0]

    @property
    def remedy(self) -> str:
        return STORAGE_ERRNO[self.errno][1]

    @property
    def reason(self) -> str:
        return REASONS[self.errno]

    def line(self) -> str:
        """`no space left on /small (0 B free of 24 MiB) writing /small/runs/.../steps.jsonl`."""
        where = mount_point(Path(self.path))
        space = space_text(Path(self.path))
        return f"{self.words} on {where}{f' ({space})' if space else ''} writing {self.path}"


class FaultLatch:
    """The first storage fault of this process; later ones are the same story."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the checkpoint writer thread notes too
        self.first: Fault | None = None

    def note(self, err: BaseException, path: Path | str | None = None) -> bool:
        """Keep `err` when it is a storage fault (True); anything else is not this latch's (False)."""
        found = storage_error(err)
        if found is None:
            return False
        with self._lock:
            if self.first is None:
                named = found.filename if found.filename is not None else path
                self.first = Fault(int(found.errno or 0), str(named) if named is not None else "(a file of the run)")
        return True

    @property
    def noted(self) -> bool:
        return self.first is not None

    def clear(self) -> None:
        with self._lock:
            self.first = None


FAULTS = FaultLatch()


@contextmanager
def refused_writes_noted(path: Path | str | None) -> Iterator[None]:
    """A storage fault inside the block is noted (FAULTS), not raised; any other error is raised."""
    try:
        yield
    except OSError as err:
        if not FAULTS.note(err, path):
            raise


class StorageFailure(RuntimeError):
    """Raised on every rank at the same step boundary once any rank noted a storage fault: the run
    ends there, with `line` (the fault in words, naming the rank when it was not this one)."""

    def __init__(self, line: str, step: int, fault: Fault | None, rank: int | None = None) -> None:
        super().__init__(line)
        self.line, self.step, self.fault, self.rank = line, step, fault, rank

    @property
    def reason(self) -> str:
        return self.fault.reason if self.fault is not None else "storage fault"

    @property
    def remedy(self) -> str:
        return self.fault.remedy if self.fault is not None else "fix the file system"

    @property
    def lasting(self) -> bool:
        """Whether a restart would meet it again (full, over quota, read-only)."""
        return self.fault is None or self.fault.errno in LASTING_STORAGE_ERRNO


FAULT_BYTES = 2048  # one rank's fault in the agreement: errno, path and line, UTF-8, cut to fit


def encoded(fault: Fault | None) -> bytes:
    if fault is None:
        return b""
    return f"{fault.errno}\t{fault.path}\t{fault.line()}".encode()[:FAULT_BYTES]


def agreed_fault(comm: Any, mine: Fault | None, step: int) -> StorageFailure | None:
    """Every rank's fault gathered (one collective: every rank calls it at the same point); the
    failure every rank raises alike (the lowest faulting rank's line), or None when no rank
    faulted. Names the rank when it was not this one."""
    import torch

    buffer = torch.zeros(FAULT_BYTES, dtype=torch.uint8)
    mine_bytes = encoded(mine)
    buffer[: len(mine_bytes)] = torch.frombuffer(bytearray(mine_bytes), dtype=torch.uint8) if mine_bytes else buffer[:0]
    gathered = comm.allgather(buffer).view(-1, FAULT_BYTES)
    for rank, row in enumerate(gathered.tolist()):
        text = bytes(row).rstrip(b"\0").decode(errors="replace")
        if not text:
            continue
        number, path, line = (text.split("\t", 2) + ["", ""])[:3]
        fault = Fault(int(number), path) if number.isdigit() and int(number) in STORAGE_ERRNO else None
        told = line if rank == comm.rank or comm.world_size == 1 else f"{line} (rank {rank})"
        return StorageFailure(told, step, fault, rank)
    return None
