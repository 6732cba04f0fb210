"""Warm ranks: one process per node of a Slurm job imports what a rank imports (torch, the
toolkit) once, before any rank needs it, and forks a rank from that state when one starts.

    python -u -m hpc.rank.warm [RUN_DIR]   (one per node, each in a one-task srun step: hpc.slurm.warmnodes;
                                            one beside mpirun for a local run: hpc.launching.ranks)

RUN_DIR is not read: it names the run on the command line, which a fork keeps (hpc.rankprocs).

The ranks' step starts as always (`srun ... python -m hpc.rank.main RUN_DIR`). Each of its tasks
is then a small client (the first lines of hpc.rank.main, standard library only): it hands its
node's warm process its environment, working directory, arguments, CPU set, umask and standard
streams, and the warm process forks; the fork is the rank, with the client's place in the job
(its SLURM_*, PMIx and liveness variables: MPI is first initialised in the fork). The client
passes every signal it gets on to the rank, and ends as the rank ended (its exit code, or killed
by the same signal), so srun, Slurm and the step supervisor see what they saw before. A rank
started again in the allocation (a crash, a lost node's ranks on the spare) costs a fork and MPI's
start instead of an interpreter and its imports; at the job's start, one import per node instead
of one per rank. Where no warm process answers, the client starts the rank itself (cold).

Why one step per node: Slurm ends a step whose node fails, with every process forked in it, on
all of its nodes; a rank forked on a node that lives must not go with a node that died.

Only the job's own ranks get a fork: the socket is abstract (Linux), named for the user, the job
and the node, a client must be the same user (SO_PEERCRED), and its request must carry the
job's token, which only the ranks' environment holds (HPCTK_WARM).
"""

from __future__ import annotations

import array
import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from hpc.env import (
    MEMORY_VARIABLE,
    WARM_ADDRESS_VARIABLE,
    WARM_FRAMEWORKS,
    WARM_IMPORTS_VARIABLE,
    WARM_VARIABLE,
    checkpoint_memory,
    job_id,
    private_dir,
    task_place,
)
from hpc.rank import dynamo, parking
from hpc.rank import signals as rank_signals

# What a rank imports before its first step, whatever it trains: imported once per node. Nothing
# here may start a Python thread or initialise MPI (mpi4py.MPI): a fork would inherit half of it.
WARM_MODULES = (
    "torch",  # torch._dynamo after it: its stand-in (hpc.rank.dynamo), or the real one where the job needs it (WARM_IMPORTS_VARIABLE)
    "numpy",
    "numpy.random",  # numpy's lazy part: the data order, the augmentations (a fork draws its own streams: _fresh_random_streams)
    "omegaconf",
    "h5py",
    "hpc.rank.main",
    "hpc.rank.script",
    "hpc.config.schema",
    "hpc.liveness",
    "collectives.backends",
    "collectives.gradsync",
    "collectives.optimizer",
    "collectives.replicated",
    "collectives.zero",
    "collectives.fsdp",
    "collectives.tuning",
    "collectives.mpi",  # mpi4py.MPI (MPI_Init) only when a rank uses it
    "trainers.loop.fit",
    "trainers.checkpoint.checkpointer",
    "trainers.checkpoint.recovery",
    "trainers.data.loader",
    "trainers.data.datasets",
    "trainers.tasks.classify",
    "trainers.reporting.trackers",
)
REQUEST_LIMIT = 4 << 20  # bytes: an environment and arguments, never more
REQUEST_S = 5.0  # a client says what it wants at once: one that does not is dropped
# A client waits this long for its rank's pid (the warm process may still be importing: torch from
# a busy shared file system can take minutes), then starts the rank itself; a fork that comes
# later sees its client gone and ends.
HANDSHAKE_S = 600.0
CONNECT_S = 5.0  # a task waits this long for its node's warm process to listen (its srun started beside the ranks')
CONNECT_VARIABLE = "HPCTK_WARM_CONNECT_S"  # another wait than CONNECT_S
BACKLOG = 1024  # clients queued while the warm process imports: a node's tasks, many times over
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT, signal.SIGCONT, signal.SIGALRM)
_HEADER = struct.Struct("!I")
# Signals the warm process ignores: a stop (cluster.signal, scancel --signal) reaches every step
# of the job, and a warm process that died of it would take its forks with it when Slurm ends its
# step. It ends when its standard input does, or by SIGKILL, or after SIGTERM (below).
IGNORED_HERE = (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM)
# Slurm's end of the job (scancel, a preemption, the time limit): the warm process ends once the
# ranks it forked have (they save first); one with none ends at once. Ignored, it held the job's
# nodes for KillWait after every scancel, until Slurm's SIGKILL.
ENDS_HERE = signal.SIGTERM
_forked_at: list[float] = []  # in a fork: when it was made (the rank's log says so: forked_line)
_frameworks: list[str] = []  # the script's frameworks imported here (forked_line says which)


def address(env: Mapping[str, str]) -> str | None:
    """The abstract socket name of this node's warm process for this job: a local run's, named
    (WARM_ADDRESS_VARIABLE); a Slurm job's, from the job and the node; None for neither."""
    if named := env.get(WARM_ADDRESS_VARIABLE):
        return f"\0{named}"
    job = job_id(env)
    if job is None:
        return None
    node = task_place(env)[1]
    return f"\0hpctk-warm.{os.getuid()}.{job}.{node}"


# The client: a task of the ranks' step.


def hand_over(env: MutableMapping[str, str], module: str) -> None:
    """Run `module` (hpc.rank.main) as a fork of this node's warm process, and end as it ends.
    Returns only when no warm process took the rank: the caller then starts it itself, without
    the token in `env` (a job it submits must not wait for this job's warm processes)."""
    name, token = address(env), env.pop(WARM_VARIABLE, None)
    env.pop(WARM_ADDRESS_VARIABLE, None)
    if not token or name is None:
        return
    client = connected(name, float(env.get(CONNECT_VARIABLE) or CONNECT_S))
    if client is None:
        return  # no warm process on this node (not started, failed, ended): a cold start
    try:
        client.settimeout(HANDSHAKE_S)
        request = {
            "token": token,
            "module": module,
            "argv": sys.argv,
            "env": dict(env),  # without the token
            "cwd": os.getcwd(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "umask": _umask(),
            "started": rank_signals.process_started(),
        }
        payload = json.dumps(request).encode()
        client.sendmsg([_HEADER.pack(len(payload))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        client.sendall(payload)
        reader = client.makefile("r", encoding="utf-8")
        first = reader.readline().split()
        client.settimeout(None)
    except OSError:
        client.close()
        return  # no warm process on this node (not started, ended, refused): a cold start
    if len(first) != 2 or first[0] != "pid":
        client.close()
        return
    _follow(int(first[1]), reader)


def connected(name: str, within_s: float) -> socket.socket | None:
    """A connection to the warm process `name`, tried for `within_s`: the ranks' step starts as
    the warm steps do, and its tasks may come before the warm process listens."""
    deadline = time.monotonic() + within_s
    while True:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(name)
            if peer_uid(client) != os.getuid():  # an abstract name anyone may take first: never hand them the rank
                client.close()
                return None
            return client
        except OSError:
            client.close()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    return int(struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1])


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _follow(pid: int, reader: Any) -> NoReturn:
    """Pass signals on to the rank `pid` and end as it ends ('exit N' from the rank, 'signal N'
    from the warm process that reaped it; nothing: killed with its node's warm process)."""

    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    early = rank_signals.caught_early()  # caught before the rank had a pid
    if early is not None:
        forward(signal.Signals[early[0]], None)
    try:
        words = reader.readline().split()
    except OSError:
        words = []
    sys.stdout.flush()
    if len(words) == 2 and words[0] == "exit":
        os._exit(int(words[1]))
    died_of = int(words[1]) if len(words) == 2 and words[0] == "signal" else signal.SIGKILL
    if died_of not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(died_of, signal.SIG_DFL)
    os.kill(os.getpid(), died_of)
    os._exit(128 + died_of)


# The warm process: one per node.


def serve(env: Mapping[str, str], modules: Sequence[str] = WARM_MODULES) -> int:
    """Listen (`listening NODE` on stdout: the ranks' step may start), import `modules` while
    the first clients wait in the queue (`ready NODE SECONDS`), and fork a rank for each client
    until the standard input ends (the supervisor is done) or the step does. A failed import
    closes the socket: the waiting clients start their ranks cold."""
    name, token = address(env), env.get(WARM_VARIABLE)
    node = task_place(env)[1]
    if name is None or not token:
        print(f"hpc-warm: failed {node}: not a Slurm job step with {WARM_VARIABLE} set", flush=True)
        return 2
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(name)
        listener.listen(BACKLOG)
    except OSError as err:  # the name is taken (by whom, the clients check: SO_PEERCRED)
        print(f"hpc-warm: failed {node}: cannot listen: {err}", flush=True)
        return 1
    print(f"hpc-warm: listening {node}", flush=True)
    began = time.monotonic()
    failure = warm_up(modules, frameworks(env))  # a SIGTERM meanwhile ends it (no rank forked yet: the queued clients start cold)
    if failure is not None:
        listener.close()
        print(f"hpc-warm: failed {node}: {failure}", flush=True)
        return 1
    server = WarmServer(listener, token, node_memory(env))
    signal.signal(ENDS_HERE, server.end_when_ranks_have)
    print(f"hpc-warm: ready {node} {time.monotonic() - began:.2f}", flush=True)
    try:
        server.run()
    finally:
        if server.memory is not None:  # the allocation's copies end with it (a new one starts empty)
            shutil.rmtree(server.memory, ignore_errors=True)
            with contextlib.suppress(OSError):
                server.memory.parent.rmdir()  # the job's, once no node of it on this machine holds any
    return 0


def node_memory(env: Mapping[str, str]) -> Path | None:
    """This node's directory for the newest checkpoint's copies (trainers.checkpoint.memory),
    made for the warm process's lifetime: None where there is no tmpfs or it cannot be made, and
    for a local run (never restarted in place: nothing would read the copies)."""
    job = job_id(env)
    if job is None:
        return None
    root = checkpoint_memory(job, task_place(env)[1])
    # Each level made private, or refused where another user made it first (the tmpfs is every
    # user's). What a former warm process of this allocation (or a SIGKILLed one of a former
    # start of the job) left is kept: a copy is used only as the committed marker names it.
    for level in (root.parent.parent, root.parent, root):
        with contextlib.suppress(FileExistsError, OSError):
            os.mkdir(level, 0o700)
        if not private_dir(level):  # no tmpfs here, or not ours: the ranks read the store
            return None
    return root


def frameworks(env: Mapping[str, str]) -> list[str]:
    """What launch.py names for this job (WARM_IMPORTS_VARIABLE: the real torch._dynamo, a script's
    frameworks), those of WARM_FRAMEWORKS alone: whatever else a job's environment names is left to its ranks."""
    return [name for name in env.get(WARM_IMPORTS_VARIABLE, "").split(",") if name in WARM_FRAMEWORKS]


def warm_up(modules: Sequence[str], optional: Sequence[str] = ()) -> str | None:
    """Import `modules`, then `optional` (a script's frameworks: one that fails to import is said
    and left to the ranks, whose own import tells them why); why this process cannot fork ranks, or None."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - said in one line; the ranks start cold
            return f"importing {module}: {type(err).__name__}: {err}"
        if module == "torch" and dynamo.NAME not in optional:
            dynamo.stand_in()  # before the modules below, whose imports may name it
    for module in optional:
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - said in one line; each rank imports it itself
            print(f"hpc-warm: not imported here: {module}: {type(err).__name__}: {err}", flush=True)
        else:
            _frameworks.append(module)
    # Python threads would be lost in the fork holding whatever locks they held. Native pools
    # (OpenBLAS's, started by numpy's import) are re-made in a fork by their own atfork handlers.
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by the imports (a fork cannot use it)"
    if threading.active_count() != 1 or "mpi4py.MPI" in sys.modules:
        return f"{threading.active_count()} Python threads, mpi4py.MPI imported: {'mpi4py.MPI' in sys.modules}"
    gc.freeze()  # the imports' objects stay where they are: a fork's collections do not copy their pages
    return None


class WarmServer:
    """The warm process's loop: accept a client, fork its rank, tell the client of a rank that
    died of a signal (woken by SIGCHLD: a killed rank's step ends at once)."""

    def __init__(self, listener: socket.socket, token: str, memory: Path | None = None) -> None:
        self.listener, self.token, self.memory = listener, token, memory
        self.children: dict[int, socket.socket | None] = {}  # None: parking or parked, no client
        self.gone: set[int] = set()  # ranks whose client is gone, killed, not yet reaped
        # In-process restarts (hpc.rank.parking): each fork's end of its park channel, the places of
        # those that may park, those parking (until when) and parked (by place, until when), and
        # the requests that wait for a rank of their place to park.
        self.channels: dict[int, socket.socket] = {}
        self.places: dict[int, str | None] = {}  # each rank's place: its task's (SLURM_LOCALID, GPUs)
        self.slots: dict[int, str] = {}
        self.parking: dict[int, float] = {}
        self.parked: dict[str, tuple[int, float]] = {}
        self.held: list[tuple[str, socket.socket, dict[str, Any], list[int], float]] = []
        self.ending = False  # SIGTERM came: no more forks, and the end once every rank's
        self.hold_s = float(os.environ.get(parking.HOLD_VARIABLE) or parking.HOLD_S)
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def end_when_ranks_have(self, signum: int, frame: object) -> None:
        self.ending = True  # the loop, woken by the wakeup fd, closes the listener

    def run(self) -> None:
        """Until the supervisor closes this step's standard input (srun passes the close on), or
        SIGTERM comes, and then until no rank it forked lives."""
        stdin_open = True
        while True:
            watched = [*([] if self.ending else [self.listener]), *([sys.stdin] if stdin_open else [])]
            clients = [c for pid, c in self.children.items() if pid not in self.gone and c is not None]
            readable, _, _ = select.select([*watched, self.wake_r, *clients, *self.channels.values()], [], [], self.next_deadline())
            if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
                # the supervisor is done, or the batch shell died of the job's SIGTERM with the
                # ranks still saving: they end (their clients gone) before this process does
                stdin_open, self.ending = False, True
            if self.wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            self.reap()
            # The ends of clients, then the ranks' words, then new clients: a task that came with
            # its place's old task's end finds that place's rank parking (or parked), not a gap.
            for pid, conn in list(self.children.items()):
                if conn is not None and conn in readable:
                    self.client_gone(pid, conn)
            for pid, channel in list(self.channels.items()):
                if channel in readable:
                    self.heard(pid, channel)
            if self.listener in readable and not self.ending:
                self.accept()
            self.expire()
            if self.ending:
                self.listener.close()  # a client still to come starts its rank cold
                self.end_parked()
                if not self.children:
                    return

    def client_gone(self, pid: int, conn: socket.socket) -> None:
        """A client never writes after its request: readable means gone (srun's task was killed),
        and its rank goes with it, with its loader workers, whatever its threads are doing."""
        with contextlib.suppress(OSError):
            if conn.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK):
                return
        channel = self.channels.get(pid)
        if channel is not None and pid not in self.slots:
            self.heard(pid, channel)  # its `armed` came with its client's end: heard first
        if pid in self.slots and not self.ending and not stopped(pid):  # it parks (its own thread saw the end too): the next step may take it
            conn.close()
            self.children[pid] = None
            self.parking[pid] = time.monotonic() + parking.PARK_WITHIN_S
            return
        self.kill(pid)

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            uid = peer_uid(conn)
            if uid != os.getuid():
                raise ValueError(f"a client of uid {uid}")
            conn.settimeout(REQUEST_S)
            request, fds = _read_request(conn)
            if request.get("token") != self.token or len(fds) != 3:
                raise ValueError("a request without the job's token and three streams")
            slot = place_of(request)
        except Exception as err:  # noqa: BLE001 - one bad request (even JSON nested past the recursion limit) never ends the node's ranks
            print(f"hpc-warm: a request refused: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            _drop(conn, fds)
            return
        self.place(slot, conn, request, fds)

    def place(self, slot: str | None, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        """The request's rank: the rank parked at its place, or one still parking there (the
        request waits for it), else a fork."""
        if slot is not None and slot in self.parked:
            pid, _ = self.parked.pop(slot)
            if self.adopt(pid, conn, request, fds, slot):
                return
        if slot is not None and any(self.slots.get(pid) == slot for pid in self.parking):
            self.held.append((slot, conn, request, fds, time.monotonic() + self.hold_s))
            return
        self.fork(conn, request, fds)

    def fork(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        ours, theirs = socket.socketpair()  # the park channel (hpc.rank.parking)
        try:
            pid = os.fork()
        except OSError as err:
            print(f"hpc-warm: a request refused: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            _drop(conn, fds)
            ours.close()
            theirs.close()
            return
        if pid == 0:
            self.leave()
            ours.close()
            _become_rank(conn, request, fds, self.memory, theirs)
        theirs.close()
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # its group exists before any killpg below (the fork sets it too)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        ours.settimeout(REQUEST_S)  # a stopped rank never blocks this loop for longer
        self.channels[pid] = ours
        self.places[pid] = place_of(request)

    def adopt(self, pid: int, conn: socket.socket, request: dict[str, Any], fds: list[int], slot: str) -> bool:
        """Hand the parked rank `pid` the request, its streams and its client (SCM_RIGHTS); False
        where it cannot be told (it died or was stopped meanwhile): ended, and the caller forks."""
        payload = json.dumps(request).encode()
        try:
            if stopped(pid):
                raise OSError("stopped")
            channel = self.channels[pid]
            channel.sendmsg([_HEADER.pack(len(payload))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [*fds, conn.fileno()]))])
            channel.sendall(payload)
        except (OSError, KeyError):
            self.kill(pid)
            return False
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.places[pid] = slot
        return True

    def heard(self, pid: int, channel: socket.socket) -> None:
        """A fork's word on its park channel: `armed` (it may park, at the place of its request),
        `disarmed`, `parked`. Nothing where its words were read already (with its client's end, in
        the same turn of the loop): a read would wait, and an empty one would forget the rank."""
        if not select.select([channel], [], [], 0)[0]:
            return
        try:
            words = channel.recv(4096).decode(errors="replace").split("\n")
        except OSError:
            words = []
        if not any(words):  # it ended: reaped below
            self.forget(pid)
            return
        for said in words:
            if said == "armed" and self.places.get(pid) is not None:
                self.slots[pid] = str(self.places[pid])
            elif said == "disarmed":
                self.slots.pop(pid, None)
            elif said == "parked":
                self.on_parked(pid)

    def on_parked(self, pid: int) -> None:
        conn = self.children.get(pid)
        if pid not in self.parking and conn is not None and at_eof(conn):
            self.client_gone(pid, conn)  # its client's end and its word came together: the end first
        slot = self.slots.pop(pid, None)
        if self.parking.pop(pid, None) is None or slot is None or self.ending:
            self.kill(pid)  # parked with its client still there, or nothing will take it
            return
        waiting = next((entry for entry in self.held if entry[0] == slot), None)
        if waiting is not None:
            self.held.remove(waiting)
            if not self.adopt(pid, *waiting[1:4], slot):
                self.fork(*waiting[1:4])
            return
        if slot in self.parked:
            self.kill(self.parked.pop(slot)[0])
        self.parked[slot] = (pid, time.monotonic() + parking.ADOPT_WITHIN_S)

    def next_deadline(self) -> float | None:
        """Seconds to the nearest parking's or parked rank's deadline; None: none."""
        deadlines = [*self.parking.values(), *(until for _, until in self.parked.values()), *(entry[4] for entry in self.held)]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def expire(self) -> None:
        """A rank not parked in time, or parked and not taken in time, is ended; a request that
        waited for it gets a fork."""
        now = time.monotonic()
        for pid, until in list(self.parking.items()):
            if now >= until:
                del self.parking[pid]
                self.slots.pop(pid, None)
                self.kill(pid)
        for slot, (pid, until) in list(self.parked.items()):
            if now >= until:
                del self.parked[slot]
                self.kill(pid)
        for slot, conn, request, fds, until in list(self.held):
            parking_here = [pid for pid in self.parking if self.slots.get(pid) == slot]
            if parking_here and now < until:
                continue
            for pid in parking_here:  # too slow to park (a stopped process, a long save): its place gets a fork
                del self.parking[pid]
                self.kill(pid)
            self.held.remove((slot, conn, request, fds, until))
            self.place(slot, conn, request, fds)

    def end_parked(self) -> None:
        """The job's end here: no step will take a parked rank."""
        for pid in [*self.parking, *(pid for pid, _ in self.parked.values())]:
            self.kill(pid)
        self.parking.clear()
        self.parked.clear()
        for _, conn, _, fds, _ in self.held:
            _drop(conn, fds)
        self.held.clear()

    def kill(self, pid: int) -> None:
        self.gone.add(pid)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)

    def leave(self) -> None:
        """In the fork: nothing of the warm process's loop stays open or armed."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        self.listener.close()
        for other in self.children.values():
            if other is not None:
                other.close()
        for channel in self.channels.values():
            channel.close()
        for _, conn, _, fds, _ in self.held:
            _drop(conn, fds)

    def forget(self, pid: int) -> None:
        """A rank reaped: nothing of its parking stays."""
        channel = self.channels.pop(pid, None)
        if channel is not None:
            channel.close()
        self.slots.pop(pid, None)
        self.places.pop(pid, None)
        self.parking.pop(pid, None)
        for slot, (parked, _) in list(self.parked.items()):
            if parked == pid:
                del self.parked[slot]

    def reap(self) -> None:
        """Tell the client of each rank that ended how it ended."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # what the rank left behind (loader workers, its own children), as Slurm's step end did
            conn = self.children.pop(pid, None)
            self.gone.discard(pid)
            self.forget(pid)
            if conn is None:
                continue
            # A rank that ends through its interpreter says how itself; one that os._exit()s (a
            # watchdog's verdict) or dies of a signal does not: said here (a second word is not read).
            said = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}"
            with contextlib.suppress(OSError):
                conn.sendall(f"{said}\n".encode())
            conn.close()


def _drop(conn: socket.socket, fds: list[int]) -> None:
    """A request not served here: its client's connection and streams closed (it starts its rank cold)."""
    for fd in fds:
        os.close(fd)
    conn.close()


def place_of(request: dict[str, Any]) -> str | None:
    """A task's place on its node, which a parked rank must share to be handed it: its local id
    and the GPUs Slurm gave it (a kept CUDA context is on those); None outside a Slurm step."""
    env = request.get("env")
    if not isinstance(env, dict) or env.get(parking.SLOT_VARIABLE) is None:
        return None
    return f"{env[parking.SLOT_VARIABLE]}/{env.get('CUDA_VISIBLE_DEVICES', '')}"


def at_eof(conn: socket.socket) -> bool:
    """Whether the other end closed (a client never writes after its request)."""
    try:
        return conn.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): a hung rank, which cannot park."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _read_request(conn: socket.socket, streams: int = 3) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(streams * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    received = list(fds)
    try:
        if len(data) < _HEADER.size:
            raise ValueError("a request cut short")
        (size,) = _HEADER.unpack(data[: _HEADER.size])
        if size > REQUEST_LIMIT:
            raise ValueError(f"a request of {size} bytes")
        body = bytearray(data[_HEADER.size :])
        while len(body) < size:
            chunk = conn.recv(min(1 << 20, size - len(body)))
            if not chunk:
                raise ValueError("a request cut short")
            body += chunk
        request = json.loads(bytes(body))
        if not isinstance(request, dict):
            raise ValueError("a request that is not an object")
        return request, received
    except (OSError, ValueError):
        for fd in received:
            os.close(fd)
        raise


# The fork: the rank.


def forked_line() -> str | None:
    """The rank's log line saying it is a fork of its node's warm process; None for a cold start."""
    if not _forked_at:
        return None
    if (adopted := parking.adopted_line(rank_signals.PROCESS_STARTED)) is not None:
        return adopted
    imported = f", {', '.join(_frameworks)} imported there" if _frameworks else ""
    return f"a fork of this node's warm process (hpc.rank.warm), {_forked_at[0] - rank_signals.PROCESS_STARTED:.2f} s after its task started{imported}"


def _become_rank(conn: socket.socket, request: dict[str, Any], fds: list[int], memory: Path | None = None, channel: socket.socket | None = None) -> NoReturn:
    """Take the client's place (streams, environment, directory, CPUs), run the rank's module as
    `python -m` would, and end the process with its exit code, told to the client first. A rank
    whose step ended under it parks instead (hpc.rank.parking) and runs again for the task that
    takes it: the same place on the node in the next step."""
    code, rank = 1, os.getpid()
    try:
        os.setpgid(0, 0)  # its own group: the rank and its loader workers end together
        rank_signals.catch_stop_signals()  # before the client learns the pid and passes signals on
        for sig in (*IGNORED_HERE, ENDS_HERE):
            if sig not in rank_signals.STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
        os.register_at_fork(after_in_child=_close_in_child)  # the rank's own children never speak for it
        _forked_at.append(time.time())
        if channel is not None:
            parking.attach(channel)
        while True:
            _client[:] = [conn]
            _fresh_random_streams()
            _take_place(conn, request, fds, memory)
            code = _run_module(str(request["module"]))
            if not parking.parking():
                break
            taken = _park(conn)
            if taken is None:
                os._exit(code)  # no client to tell: the warm process ends it anyway
            conn, request, fds = taken
    except BaseException:  # noqa: BLE001 - the fork must never return into the warm process's loop
        traceback.print_exc()
    try:
        if os.getpid() == rank:  # not a child the rank forked that came back up through runpy
            threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: non-daemon threads joined first
            atexit._run_exitfuncs()
            _finalize_mpi()
            sys.stdout.flush()
            sys.stderr.flush()
            conn.sendall(f"exit {code}\n".encode())
    finally:
        os._exit(code)


_client: list[socket.socket] = []  # in a rank: its client's connection now


def _close_in_child() -> None:
    for conn in _client:
        conn.close()
    channel = parking.channel()
    if channel is not None:
        channel.close()


def _take_place(conn: socket.socket, request: dict[str, Any], fds: list[int], memory: Path | None) -> None:
    """The client's streams, environment, directory, umask and CPUs made this process's; the
    client told its pid, and watched (its end is the rank's)."""
    rank_signals.PROCESS_STARTED = float(request.get("started") or _forked_at[0])
    for fd, target in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in dict(request["env"]).items()})
    if memory is not None:
        os.environ[MEMORY_VARIABLE] = str(memory)
    os.chdir(str(request["cwd"]))
    os.umask(int(request["umask"]))
    os.sched_setaffinity(0, [int(cpu) for cpu in request["cpus"]])
    sys.argv = [str(arg) for arg in request["argv"]]
    conn.settimeout(None)
    conn.sendall(f"pid {os.getpid()}\n".encode())
    threading.Thread(target=_end_with_client, args=(conn,), daemon=True, name="hpc-warm-client").start()


def _park(old: socket.socket) -> tuple[socket.socket, dict[str, Any], list[int]] | None:
    """The training unwound (its step ended under it): wait until every thread it started has
    ended, say `parked`, and wait for the next step's task of this place: (its client, its
    request, its streams); None where this process cannot park (the warm process ends it)."""
    old.close()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.collect()  # the training's objects (its group, its loader's workers) let go of now, not in the next run
    if not parking.threads_ended(parking.PARK_WITHIN_S / 2) or not _device_usable():
        return None
    quiet = os.open(os.devnull, os.O_RDWR)  # the old task's pipes are gone: nothing is written until the next task's
    for target in (0, 1, 2):
        os.dup2(quiet, target)
    os.close(quiet)
    channel = parking.channel()
    if channel is None or not parking.parked():
        return None
    try:
        channel.settimeout(None)
        request, fds = _read_request(channel, streams=4)
    except (OSError, ValueError):
        return None
    if len(fds) != 4:
        for fd in fds:
            os.close(fd)
        return None
    parking.adopted()
    rank_signals.forget_caught()  # what the last run caught, and the storage fault it noted, were that run's
    faults = sys.modules.get("trainers.faults")
    if faults is not None:
        faults.FAULTS.clear()
    return socket.socket(fileno=fds[3]), request, fds[:3]


def _device_usable() -> bool:
    """The CUDA context a parked rank keeps still works (a sticky error, an illegal address, ends
    it for good: the next run would fail in it), its cached blocks given back to the device."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return True
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as err:  # noqa: BLE001 - said, and the process ends: its place gets a fork
        print(f"hpc-warm: not parked: its CUDA context failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return False
    return True


def _fresh_random_streams() -> None:
    """The unseeded streams a new interpreter draws from the OS, drawn again: a fork has its warm
    process's, the same in every rank of the node (two ranks' unseeded augmentations would be
    equal). Python's `random` reseeds itself in a fork; torch's and numpy's global ones do not."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()  # not torch.seed(): it would give every GPU the CPU's seed (CUDA seeds each itself)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _finalize_mpi() -> None:
    """What the interpreter's exit does and os._exit skips: mpi4py finalises MPI from a C-level
    exit hook (Py_AtExit), not from atexit. Without it mpirun takes the rank's end for an abort.
    Only where mpi4py's would: not when told not to (MPI4PY_RC_FINALIZE, mpi4py.rc.finalize)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and _mpi4py_finalizes():
        mpi.Finalize()


def _mpi4py_finalizes() -> bool:
    """mpi4py's rule for its exit hook: MPI4PY_RC_FINALIZE, else rc.finalize, which None makes rc.initialize."""
    said = os.environ.get("MPI4PY_RC_FINALIZE")
    if said is not None:
        return said.strip().lower() in ("1", "true", "yes", "on", "y")
    rc = sys.modules["mpi4py"].rc
    return bool(rc.initialize if rc.finalize is None else rc.finalize)


def _run_module(module: str) -> int:
    """`python -m module`'s exit code: SystemExit's, 1 after an uncaught exception (its traceback
    on stderr), 130 after Ctrl-C."""
    import runpy

    sys.modules.pop(module, None)  # imported for its imports; run afresh as __main__, as `python -m` runs it
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return int(done.code or 0)
        print(done.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except parking.Parked:  # its step ended under it: not an error of its own (hpc.rank.parking)
        return 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
        return 1
    return 0


def _end_with_client(conn: socket.socket) -> None:
    """The client is srun's task: when it is gone (Slurm killed the step), so is the rank, unless
    it may park (hpc.rank.parking: its collectives are cut, and its training unwinds)."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    if _client and conn is not _client[0]:
        return  # an earlier run's client (this process parked since)
    if not parking.begin():
        os.killpg(0, signal.SIGKILL)


def main(modules: Sequence[str] = WARM_MODULES) -> int:
    for sig in IGNORED_HERE:  # the job's signals are for its ranks (their clients pass them on): never the warm process's end
        signal.signal(sig, signal.SIG_IGN)
    return serve(os.environ, modules)


if __name__ == "__main__":  # serve from the module the forks import (hpc.rank.main's forked_line reads its state)
    from hpc.cli import Parser
    from hpc.rank import warm

    parser = Parser("python -m hpc.rank.warm", __doc__ or "")
    parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="the run it serves: not read, named for ps and hpc.rankprocs")
    parser.parse_args()
    code = warm.main()
    # Not through the interpreter's exit: torch's finalisers cost 0.2 s of CPU here, seconds on a
    # loaded node, and the batch script's EXIT trap waits for this process before it requeues.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
