"""In-process restarts: a rank whose step ended under it keeps its interpreter for the next step.

When a rank dies or a node is lost, the step supervisor (hpc.slurm.supervise) ends the ranks'
step and starts a new one. A rank forked from its node's warm process (hpc.rank.warm) that
trains over torch.distributed (comm=gloo, comm=nccl: a group that can be formed again, which an
MPI world cannot without ULFM) does not die with its task: its collectives are cut, its training
unwinds to the fork's loop, every thread it started ends, and it parks; the new step's task for
the same place on the node (SLURM_LOCALID: the same GPU, whose CUDA context it keeps) is handed
this process instead of a new fork, and the rank runs again in it: the rendezvous of the new
step, the newest committed checkpoint (from node memory), the same bit-exact resume as any
restart. A rank that does not park within PARK_WITHIN_S, or is not taken within ADOPT_WITHIN_S,
is ended by the warm process, and its place gets a fork, as before.

Cutting the collectives: a survivor waits in a collective for a peer that died; Gloo's abort()
and shutdown() do not wake it (torch 2.13: measured), and a lost node's peer sends no FIN, so it
would wait for the group's timeout. Every connected TCP socket of the process is shut down
(its group's pairs, its store, the trackers' keep-alive connections: the trackers reconnect):
the waiting collective fails at once with "Connection closed by peer". NCCL's communicators are
aborted first (ncclCommAbort: what it is for).

Standard library only at import: hpc.rank.warm imports it before torch.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable

PARK_WITHIN_S = 15.0  # the client's end to the rank parked: its training unwound, its save's writer done
# The next step's task of a place waits this long for its rank still parking (unwinding, its save's
# writer ending), then gets a fork: a stopped or stuck process never holds a restart up for long.
HOLD_S = 5.0
HOLD_VARIABLE = "HPCTK_PARK_HOLD_S"  # another hold than HOLD_S (the warm process's environment)
ADOPT_WITHIN_S = 120.0  # parked without the next step's task taking it: ended (the supervisor decided not to restart here)
PEER_WAIT_S = 60.0  # a collective failed for a peer's end: the supervisor ends this step within seconds, else the rank fails as before
SLOT_VARIABLE = "SLURM_LOCALID"  # a task's place on its node: a parked rank is handed to the task of the same place


class Parked(BaseException):
    """Raised where the rank would report a failure once its step was ended under it: unwinds to
    the warm fork's loop (hpc.rank.warm), which parks it. Not an Exception: no handler of the
    training's (nor a user's `except Exception`) takes it for the training's own error."""


class _State:
    def __init__(self) -> None:
        self.channel: socket.socket | None = None  # to this node's warm process (a fork's)
        self.armed = False
        self.cutting = False  # the step ended under it: its collectives are being cut (set first)
        self.parking = threading.Event()  # ... and are cut (set last: a waiting survivor unwinds only then)
        self.parked_at: float | None = None  # when this process was adopted last (the rank's log says so)
        self.began: float | None = None  # when its last task ended (the cut)
        self.parked_after: float | None = None  # from the cut to parked: the unwinding, its threads' ends
        self.abandon: Callable[[], None] | None = None  # the collectives' own word that their peers are gone


_state = _State()


def attach(channel: socket.socket) -> None:
    """In a fork of the warm process: its end of the park channel."""
    _state.channel = channel


def arm(slot: str | None, abandon: Callable[[], None] | None = None) -> bool:
    """This rank may park from now on (its collectives can be cut and formed again; `abandon`
    tells them, at the cut, that their peers are gone); False where it cannot: not a fork of a
    warm process that keeps parked ranks, or no place on a node."""
    if _state.channel is None or slot is None or _state.armed:
        return _state.armed
    _state.abandon = abandon
    try:
        _state.channel.sendall(b"armed\n")  # the warm process knows its place (the request's)
    except OSError:
        return False
    _state.armed = True
    return True


def disarm() -> None:
    """The training is over on this rank (its summary, its exit follow): a client's end kills it again."""
    if not _state.armed:
        return
    _state.armed = False
    if _state.channel is not None:
        with contextlib.suppress(OSError):
            _state.channel.sendall(b"disarmed\n")


def begin() -> bool:
    """The client is gone (srun's task ended): where armed, cut this rank's collectives so its
    training unwinds (True); False: the caller ends the rank as before."""
    if not _state.armed:
        return False
    _state.began, _state.cutting = time.time(), True
    if _state.abandon is not None:
        _state.abandon()
    from hpc.liveness import let_go

    let_go()  # `bye` to the old step's supervisor: this process is not dead
    _abort_nccl()
    cut_connections()
    _state.parking.set()  # last: nothing unwinds into the group's destruction while NCCL's abort runs
    return True


def parking() -> bool:
    return _state.cutting


def raise_if_parking() -> None:
    """Where a rank would report a failure: the failure is its step's end, not its own."""
    if _state.cutting:
        _state.parking.wait(PARK_WITHIN_S)  # the cut finished: the group is destroyed after NCCL's abort, never during it
        raise Parked


# What torch.distributed's transports say when the other end of a collective is gone (Gloo's
# pairs, the store's connection; NCCL's remote error), raised as RuntimeError (DistError's kinds
# among them). Only these: a size mismatch Gloo enforces, or a rank's own CUDA error, is its own.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "ncclRemoteError", "remote process exited or there was a network error")


def peer_gone(err: BaseException) -> bool:
    """Whether `err` is a collective's failure for a peer gone (its rank died, its node was lost)."""
    return isinstance(err, RuntimeError) and any(said in str(err) for said in PEER_GONE)


def wait_for_end(err: BaseException, say: Callable[[str], None], within_s: float = PEER_WAIT_S) -> None:
    """An armed rank whose collective failed for a peer's end waits for its step's end (the step
    supervisor ends it and starts the next, hpc.slurm.supervise) and parks: Parked. Returns where
    not armed, or where the step did not end within `within_s` (the rank then fails as before)."""
    if not _state.armed:
        return
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    say(f"a collective failed, a peer is gone ({first[:200]}): this process waits for the step's end and trains again in the next (hpc.rank.parking)")
    if _state.parking.wait(within_s):
        raise Parked


def cut_connections() -> int:
    """Shut down every connected TCP socket of this process (both ways): whatever waits on one
    wakes with its peer gone. How many."""
    cut = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            try:
                sock.getpeername()  # a listening socket has none: the store's server accepts no more either way
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                continue
    return cut


def _abort_nccl() -> None:
    """ncclCommAbort on the default group's communicators, where NCCL runs them."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    with contextlib.suppress(Exception):  # noqa: BLE001 - the TCP cut below still wakes what it can
        dist.distributed_c10d._abort_process_group()


def threads_ended(within_s: float) -> bool:
    """Every Python thread of the training ended (its checkpoint writer among them: a staging
    file half written by this process must not meet the next step's), within `within_s`."""
    deadline = time.monotonic() + within_s
    for thread in threading.enumerate():
        if thread is threading.current_thread():
            continue
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            print(f"hpc-warm: not parked: thread {thread.name} still running", file=sys.stderr, flush=True)
            return False
    return True


def parked() -> bool:
    """Tell the warm process this rank waits to be taken; False where it cannot be told."""
    _state.parking.clear()
    _state.armed, _state.abandon, _state.cutting = False, None, False
    _state.parked_after = time.time() - _state.began if _state.began is not None else None
    if _state.channel is None:
        return False
    try:
        _state.channel.sendall(b"parked\n")
    except OSError:
        return False
    return True


def adopted() -> None:
    _state.parked_at = time.time()


def adopted_line(task_started: float) -> str | None:
    """The rank's log line saying this process trained before (an in-process restart); None for a fork's first run."""
    if _state.parked_at is None:
        return None
    taken = _state.parked_at - task_started
    parked = f"parked {_state.parked_after:.2f} s after its last task ended, " if _state.parked_after is not None else ""
    return f"an in-process restart: this process trained the last step too (hpc.rank.parking), {parked}taken {taken:.2f} s after its task started"


def channel() -> socket.socket | None:
    return _state.channel
