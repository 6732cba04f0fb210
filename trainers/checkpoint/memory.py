"""The newest checkpoint kept in the node's memory, for a restart inside the allocation.

A rank started again in the same allocation (a crash, a hang, a lost node's ranks on a spare)
reads its checkpoint back from the node's memory instead of the file system, which is the slow
part of a restart on a shared file system at scale (every rank reading the same files at once).
The warm process of each node (hpc.rank.warm) owns a directory in the node's tmpfs, made for the
allocation and removed when it ends, and hands its path to the ranks it forks in
HPCTK_MEMORY_CHECKPOINTS. After every save the writer thread copies the pieces it wrote there
(its own rank file; rank 0 also the shared file); a commit keeps that step's copies alone.

A copy is used only as the committed marker describes its piece (trainers.checkpoint.restart
reads the marker from the store): the sum recorded beside it, the one its rank computed while
writing the file it was copied from, must be the marker's, and its size the marker's. It is not
hashed again at a restart (hashing is most of the read): a copy of another save of the same step,
or one cut short, is never used; a bit flipped in memory afterwards is ECC's to catch. A piece no
node of the new step holds comes from the store, hashed as it is read (trainers.checkpoint.restart
says which piece comes from where). A new allocation (a requeue) starts with an empty directory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainers.checkpoint.layout import step_dir_name, step_number

log = logging.getLogger("trainers.checkpoint.memory")

MEMORY_VARIABLE = "HPCTK_MEMORY_CHECKPOINTS"  # the node's directory for this allocation (set by hpc.rank.warm)
# The node's tmpfs also holds what DataLoader workers, NCCL and MPI share between processes:
# a copy that would leave less than this part of it free is not made.
KEEP_FREE = 0.5
SUM = ".sum"  # beside each copy: its size and sha256, as its rank wrote them (trainers.checkpoint.checkpointer)


def room_short(root: Path, size: int) -> str | None:
    """Why a copy of `size` bytes is not made here; None: there is room. The tmpfs must keep
    KEEP_FREE of it free, and the job's memory cgroup (which tmpfs pages count against, where
    Slurm confines jobs) KEEP_FREE of its limit."""
    room = os.statvfs(root)
    if size > room.f_bavail * room.f_frsize - KEEP_FREE * room.f_blocks * room.f_frsize:
        return f"{size} bytes would leave under {KEEP_FREE:.0%} of the tmpfs free"
    limit, used = cgroup_memory()
    if limit is not None and used is not None and size > limit - used - KEEP_FREE * limit:
        return f"{size} bytes would leave under {KEEP_FREE:.0%} of the job's memory limit ({limit >> 20} MiB) free"
    return None


def cgroup_memory(proc: Path = Path("/proc/self/cgroup"), mount: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, int | None]:
    """(limit, usage) in bytes of this process's cgroup v2 memory controller; None where unknown or unlimited."""
    try:
        relative = next(line.split(":", 2)[2] for line in proc.read_text().splitlines() if line.startswith("0::"))
        where = mount / relative.strip().lstrip("/")
        limit_text = (where / "memory.max").read_text().strip()
        used = int((where / "memory.current").read_text())
    except (OSError, StopIteration, ValueError, IndexError):
        return None, None
    return (None if limit_text == "max" else int(limit_text)), used


class MemoryCopies:
    """One node's copies of the checkpoints its ranks wrote, keyed by the store they went to."""

    def __init__(self, root: Path, store_url: str) -> None:
        self.root = root / hashlib.sha1(store_url.encode()).hexdigest()[:16]
        self._failed = False

    @classmethod
    def from_env(cls, store_url: str) -> MemoryCopies | None:
        root = os.environ.get(MEMORY_VARIABLE)
        return cls(Path(root), store_url) if root else None

    def _path(self, step: int, name: str) -> Path:
        return self.root / step_dir_name(step) / name

    def hold(self, step: int, name: str, written: Path) -> None:
        """Copy piece `name` of step `step` (the file `written`, its size and sha256 in the
        `.sum` file beside it, as the writer left them) into memory. A full tmpfs or any other
        failure costs the copy only (said once): the store holds the checkpoint."""
        try:
            summary = json.loads(written.with_name(written.name + SUM).read_bytes())
        except (OSError, ValueError) as err:
            self._skipped(err)
            return
        self._put(step, name, summary, lambda partial: shutil.copyfile(written, partial))

    def hold_bytes(self, step: int, name: str, data: bytes | memoryview, sha256: str | None) -> None:
        """Piece `name` of step `step`, received from another rank, held here too; `sha256`: the
        marker's, or None to hash it here (a small piece sent before the marker was read)."""
        summary = {"bytes": len(data), "sha256": sha256 or hashlib.sha256(data).hexdigest()}
        self._put(step, name, summary, lambda partial: partial.write_bytes(data))

    def size(self, step: int, name: str) -> int | None:
        """The size of a copy this node holds whole (its size the one recorded beside it); None: none."""
        path = self._path(step, name)
        try:
            size = path.stat().st_size
            return size if size == int(json.loads(path.with_name(name + SUM).read_bytes())["bytes"]) else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def read(self, step: int, name: str) -> bytes | None:
        try:
            return self._path(step, name).read_bytes()
        except OSError:
            return None

    def claim(self, step: int, what: str) -> bool:
        """True for the first of the node's ranks to ask (for `what` of step `step`): one writes for all."""
        try:
            os.close(os.open(self._path(step, f".claimed-{what}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except OSError:
            return False

    def _put(self, step: int, name: str, summary: dict[str, Any], write: Callable[[Path], object]) -> None:
        target = self._path(step, name)
        # named for the process and thread: two ranks of a node may hold the same piece at once (a send)
        unique = f"{os.getpid()}.{threading.get_ident()}"
        partial, partial_sum = (target.with_name(f".{name}{suffix}.{unique}.partial") for suffix in ("", SUM))
        try:
            # never the node's directory (its warm process made it, and removes it at its end: a
            # late writer must not make it again)
            self.root.mkdir(exist_ok=True)
            target.parent.mkdir(exist_ok=True)
            short = room_short(self.root, int(summary["bytes"]))
            if short:
                raise OSError(errno.ENOSPC, short)
            write(partial)
            partial_sum.write_text(json.dumps(summary))
            target.with_name(name + SUM).unlink(missing_ok=True)  # no moment where new bytes sit beside an old sum
            os.replace(partial, target)
            os.replace(partial_sum, target.with_name(name + SUM))  # last: the copy is whole
        except OSError as err:
            for leftover in (partial, partial_sum):
                with contextlib.suppress(OSError):
                    leftover.unlink(missing_ok=True)
            self._skipped(err)

    def _skipped(self, err: OSError | ValueError) -> None:
        if not self._failed:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else err
            log.warning("the checkpoint's copy in node memory (%s) skipped: %s; restarts read the store", self.root, reason)
        self._failed = True

    def find(self, step: int, name: str, expected: dict[str, Any]) -> Path | None:
        """The copy of piece `name` of step `step` if held as the marker describes it (`expected`:
        its bytes and sha256); else None. The copy was made from the file its rank wrote and
        hashed, and is not hashed again (that is most of a restart's read): its recorded sum
        must be the marker's (not a copy of another save of the same step) and its size the
        marker's (not cut short)."""
        path = self._path(step, name)
        try:
            recorded = json.loads(path.with_name(name + SUM).read_bytes())
            whole = recorded.get("sha256") == expected["sha256"] and path.stat().st_size == int(expected["bytes"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return path if whole else None

    def keep_only(self, step: int) -> None:
        """Drop every step's copies but `step`'s (the one just committed)."""
        for held in self.steps():
            if held != step:
                self.drop(held)

    def drop(self, step: int) -> None:
        shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)

    def steps(self) -> list[int]:
        try:
            names = [p.name for p in self.root.iterdir()]
        except OSError:
            return []
        return sorted(s for n in names if (s := step_number(n)) is not None)
