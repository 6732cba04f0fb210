"""Which failures of a rank would repeat on a restart and which need not.

Repeats (the job ends, is not restarted or requeued): the user's own deterministic errors, a
config or task error (TaskError, a backend the ranks cannot start, a TypeError or AttributeError
in the code, a batch that does not fit memory), a checkpoint that cannot be resumed by this job,
a diverged run, a bad or missing data file. Everything else (an NCCL or Gloo
timeout, an I/O error on a shared file system, a loader process killed by the out-of-memory
killer, a peer lost, a bug that shows only sometimes) is a failure counted against the job's
failure budget, as a killed rank is: restarts inside the allocation, then requeues, each from the
newest committed checkpoint.
"""

from __future__ import annotations

import errno

# An OSError with these errno values names a file that is not there or not allowed: the same on
# every start. Others (EIO, ESTALE, ETIMEDOUT, ENOSPC, ...) come and go on shared file systems.
# A bug in the code (the user's task or ours) or a batch that does not fit memory: the same on every start.
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, ImportError, SyntaxError, NotImplementedError, MemoryError)
LASTING_ERRNO = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP}


def repeats(err: BaseException) -> bool:
    """Whether `err` would happen again on every restart (see the module's docstring)."""
    from collectives.base import CollectivesError
    from hpc.errors import UserError
    from trainers.checkpoint import CheckpointError
    from trainers.datasets import DataError
    from trainers.guard import DivergedError
    from trainers.task import TaskError

    if isinstance(err, TaskError | CheckpointError | DivergedError | DataError | UserError | CollectivesError):
        return True
    if isinstance(err, PROGRAMMING_ERRORS) or type(err).__name__ == "OutOfMemoryError":  # torch's, CUDA's: the batch does not fit
        return True
    if isinstance(err, OSError) and not isinstance(err, ConnectionError | TimeoutError):
        return err.errno in LASTING_ERRNO or (err.errno is None and "No such file" in str(err))
    return False


def one_line(err: BaseException) -> bool:
    """The user-fixable errors whose message is the whole story (no traceback in the log)."""
    from trainers.checkpoint import CheckpointError
    from trainers.guard import DivergedError
    from trainers.task import TaskError

    return isinstance(err, CheckpointError | TaskError | DivergedError)
