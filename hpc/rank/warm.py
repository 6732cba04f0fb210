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
from hpc.rank import dynamo
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
        self.children: dict[int, socket.socket] = {}
        self.gone: set[int] = set()  # ranks whose client is gone, killed, not yet reaped
        self.ending = False  # SIGTERM came: no more forks, and the end once every rank's
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
            readable, _, _ = select.select([*watched, self.wake_r, *(c for pid, c in self.children.items() if pid not in self.gone)], [], [])
            if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
                # the supervisor is done, or the batch shell died of the job's SIGTERM with the
                # ranks still saving: they end (their clients gone) before this process does
                stdin_open, self.ending = False, True
            if self.wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            if self.listener in readable and not self.ending:
                self.accept()
            self.reap()
            if self.ending:
                self.listener.close()  # a client still to come starts its rank cold
                if not self.children:
                    return
            for pid, conn in list(self.children.items()):
                if conn in readable:
                    self.client_gone(pid, conn)

    def client_gone(self, pid: int, conn: socket.socket) -> None:
        """A client never writes after its request: readable means gone (srun's task was killed),
        and its rank goes with it, with its loader workers, whatever its threads are doing."""
        with contextlib.suppress(OSError):
            if conn.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK):
                return
        self.gone.add(pid)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)

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
            pid = os.fork()
        except Exception as err:  # noqa: BLE001 - one bad request (even JSON nested past the recursion limit) never ends the node's ranks
            print(f"hpc-warm: a request refused: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        if pid == 0:
            self.leave()
            _become_rank(conn, request, fds, self.memory)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # its group exists before any killpg below (the fork sets it too)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn

    def leave(self) -> None:
        """In the fork: nothing of the warm process's loop stays open or armed."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        self.listener.close()
        for other in self.children.values():
            other.close()

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
            if conn is None:
                continue
            # A rank that ends through its interpreter says how itself; one that os._exit()s (a
            # watchdog's verdict) or dies of a signal does not: said here (a second word is not read).
            said = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}"
            with contextlib.suppress(OSError):
                conn.sendall(f"{said}\n".encode())
            conn.close()


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
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
    imported = f", {', '.join(_frameworks)} imported there" if _frameworks else ""
    return f"a fork of this node's warm process (hpc.rank.warm), {_forked_at[0] - rank_signals.PROCESS_STARTED:.2f} s after its task started{imported}"


def _become_rank(conn: socket.socket, request: dict[str, Any], fds: list[int], memory: Path | None = None) -> NoReturn:
    """Take the client's place (streams, environment, directory, CPUs), run the rank's module as
    `python -m` would, and end the process with its exit code, told to the client first."""
    code, rank = 1, os.getpid()
    try:
        os.setpgid(0, 0)  # its own group: the rank and its loader workers end together
        rank_signals.catch_stop_signals()  # before the client learns the pid and passes signals on
        for sig in (*IGNORED_HERE, ENDS_HERE):
            if sig not in rank_signals.STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
        os.register_at_fork(after_in_child=conn.close)  # the rank's own children never speak for it
        _forked_at.append(time.time())
        _fresh_random_streams()
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
        code = _run_module(str(request["module"]))
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
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
        return 1
    return 0


def _end_with_client(conn: socket.socket) -> None:
    """The client is srun's task: when it is gone (Slurm killed the step), so is the rank."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
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
