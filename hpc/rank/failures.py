"""Which failures of a rank would repeat on a restart and which need not.

Repeats (the job ends, is not restarted or requeued): the user's own deterministic errors, a
config or task error (TaskError, a backend the ranks cannot start, a TypeError or AttributeError
in the code, a batch that does not fit memory), a checkpoint that cannot be resumed by this job,
a diverged run, a bad or missing data file. Everything else (an NCCL or Gloo
timeout, an I/O error on a shared file system, a loader process killed by the out-of-memory
killer, a peer lost, a bug that shows only sometimes) is a failure counted against the job's
failure budget, as a killed rank is: restarts inside the allocation, then requeues, each from the
newest committed checkpoint.

The list is a guess; evidence beats it. Every failure is recorded in the run dir
(`failures.jsonl`: the error and the newest step reported), and an error that comes back the
same (type and message) at the same step after a restart is taken to repeat: a deterministic bug
(`IndexError: Target 7 is out of bounds` from a task with 5 outputs) costs one restart, not the
job's whole failure budget.
"""

from __future__ import annotations

import errno
import json
import sysconfig
import time
from pathlib import Path
from types import TracebackType

# An OSError with these errno values names a file that is not there or not allowed: the same on
# every start. Others (EIO, ESTALE, ETIMEDOUT, ENOSPC, ...) come and go on shared file systems.
# A bug in the code (the user's task or ours) or a batch that does not fit memory: the same on every start.
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, ImportError, SyntaxError, NotImplementedError, MemoryError)
LASTING_ERRNO = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP}


def repeats(err: BaseException) -> bool:
    """Whether `err` would happen again on every restart (see the module's docstring)."""
    from collectives.base import CollectivesError
    from hpc.errors import UserError
    from trainers.checkpoint.checkpointer import CheckpointError, StoreUnavailable
    from trainers.data.datasets import DataError
    from trainers.faults import LASTING_STORAGE_ERRNO, storage_error
    from trainers.guard import DivergedError
    from trainers.task import TaskError

    refused = storage_error(err)
    if refused is not None and refused.errno in LASTING_STORAGE_ERRNO:  # full, over quota, read-only: a restart meets it again
        return True
    if isinstance(err, StoreUnavailable):  # an object store down for longer than its retries
        return False
    if isinstance(err, TaskError | CheckpointError | DivergedError | DataError | UserError | CollectivesError):
        return True
    if isinstance(err, PROGRAMMING_ERRORS) or type(err).__name__ == "OutOfMemoryError":  # torch's, CUDA's: the batch does not fit
        return True
    if isinstance(err, OSError) and not isinstance(err, ConnectionError | TimeoutError):
        return err.errno in LASTING_ERRNO or (err.errno is None and "No such file" in str(err))
    return False


def one_line(err: BaseException) -> bool:
    """The user-fixable errors whose message is the whole story (no traceback in the log)."""
    from hpc.errors import UserError
    from trainers.checkpoint.checkpointer import CheckpointError
    from trainers.guard import DivergedError
    from trainers.task import TaskError

    return isinstance(err, CheckpointError | TaskError | DivergedError | UserError)


TOOLKIT_PACKAGES = ("hpc", "trainers", "collectives")


def from_users_frame(err: BaseException, code_root: Path) -> TracebackType | None:
    """`err`'s traceback from the first frame of the user's own code (a script, a task module)
    down: the toolkit's, runpy's and the libraries' frames above it only say how the user's code
    was called. All of it where no frame is the user's (an error in the toolkit or a library)."""
    toolkit = tuple(str(code_root / package) + "/" for package in TOOLKIT_PACKAGES)
    libraries = tuple({str(Path(sysconfig.get_paths()[key])) + "/" for key in ("stdlib", "platstdlib", "purelib", "platlib")})

    def users(filename: str) -> bool:
        return not filename.startswith("<") and not filename.startswith(toolkit) and not filename.startswith(libraries)

    tb = err.__traceback__
    while tb is not None and not users(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb if tb is not None else err.__traceback__


FAILURES = "failures.jsonl"  # in the run dir: one line per rank failure, for seen_before()


def signature(err: BaseException) -> str:
    """The error as a later start would raise it again: its type and message, in one line."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"


def newest_step(run_dir: Path) -> int | None:
    """The newest step rank 0 reported (steps.jsonl): where the run was when it failed."""
    from hpc.rundir import RunDir, last_record

    record = last_record(RunDir(run_dir).steps) or {}
    step = record.get("step")
    return step if isinstance(step, int) else None


def seen_before(run_dir: Path, err: BaseException, step: int | None, since: float | None = None) -> bool:
    """Whether an earlier start failed with the same error at the same step (failures.jsonl):
    a record written before `since` (this rank's process started). The same failure's other
    ranks write theirs after it started: the survivors of one lost peer all fail alike, and
    that is one failure, not a repeated one (seen on DDP over Gloo: a crash ended the job)."""
    try:
        lines = (run_dir / FAILURES).read_text().splitlines()
    except OSError:
        return False
    wanted = {"error": signature(err), "step": step}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if not isinstance(record, dict) or {key: record.get(key) for key in wanted} != wanted:
            continue
        written = record.get("time")
        if since is None or not isinstance(written, int | float) or written < since:
            return True
    return False


def record_failure(run_dir: Path, err: BaseException, step: int | None, rank: int) -> None:
    """One line in failures.jsonl (appended: ranks that fail together each add theirs). Best
    effort: a full disk must not hide the error itself."""
    try:
        with (run_dir / FAILURES).open("a") as f:
            f.write(json.dumps({"error": signature(err), "step": step, "rank": rank, "time": time.time()}) + "\n")
    except OSError:
        pass


def repeats_here(run_dir: Path, err: BaseException, rank: int, since: float | None = None) -> tuple[bool, str]:
    """repeats(err), or the evidence of an earlier start (one before `since`: this rank's
    process start); the failure recorded either way. Returns (whether it repeats, why: "" or
    the evidence in words)."""
    step = newest_step(run_dir)
    lasting, why = repeats(err), ""
    if not lasting and seen_before(run_dir, err, step, since):
        lasting, why = True, f"the same {type(err).__name__} at step {step} as before a restart: it repeats"
    record_failure(run_dir, err, step, rank)
    return lasting, why
