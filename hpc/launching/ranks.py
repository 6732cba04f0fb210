"""`python -m hpc.launching.ranks RUN_DIR MPIRUN_COMMAND...`: a local run's ranks, as launch.py and
the run's command.txt start them.

- mpirun runs in a session of its own, and a Ctrl-C (SIGINT), SIGTERM or SIGHUP that reaches
  this process goes to the ranks themselves. mpirun would turn a Ctrl-C into SIGTERM and SIGKILL
  the ranks one second later, maybe in the middle of their checkpoint; this way they stop at a
  step boundary and save. A second Ctrl-C ends them at once (a save in flight never commits, so
  the newest committed checkpoint stays the newest).
- The exit code is the run's: after a clean stop the ranks exit 0 (RESULT_EXIT_VARIABLE tells
  them to) and this returns the code rank 0 wrote to result.json (75: resumable). A rank that
  exits non-zero while its peers are still in MPI_Finalize can hang mpirun (Open MPI issue
  3380); all ranks exiting 0 never takes that path. Failures keep mpirun's own code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO

from hpc.env import PORT_BASE, RESULT_EXIT_VARIABLE, WARM_ADDRESS_VARIABLE, WARM_VARIABLE
from hpc.proctree import children, kill_tree
from hpc.rundir import RunDir
from hpc.runlock import RunDirBusy, hold_launch

WARM_LISTEN_S = 10.0  # the warm process's interpreter start; one that does not listen by then leaves the ranks cold
WARM_END_S = 30.0  # after mpirun: the forks are gone with their clients, so the warm process ends at once
ENDED_AT_ONCE = 130  # a second Ctrl-C: the shell's code for an end by SIGINT (mpirun, killed, read 247)


def run_in_session(command: list[str], env: dict[str, str], on_signal: Callable[[subprocess.Popen[bytes], int], None]) -> int:
    """`command` in a session of its own (a terminal's Ctrl-C does not reach it), each SIGINT,
    SIGTERM or SIGHUP that reaches this process handed to `on_signal(process, signum)`; its exit code."""
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda signum, frame: on_signal(proc, signum)) for sig in handled}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_ranks(command: list[str], env: dict[str, str]) -> int:
    """mpirun `command` in a session of its own, signals forwarded to the ranks; its exit code."""
    interrupts = 0

    def forward(proc: subprocess.Popen[bytes], signum: int) -> None:
        nonlocal interrupts
        interrupts += signum == signal.SIGINT
        if interrupts >= 2:
            print("\nsecond Ctrl-C: ending the ranks now", file=sys.stderr, flush=True)
            kill_tree(proc.pid)  # mpirun and every rank (each in a group of its own); a fork goes with its client
            return
        ranks = children(proc.pid)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signum)
        if not ranks:  # none seen (yet): mpirun passes the stop on as SIGTERM
            proc.send_signal(signal.SIGTERM)

    code = run_in_session(command, env, forward)
    return ENDED_AT_ONCE if interrupts >= 2 else code


@contextlib.contextmanager
def warm_process(env: Mapping[str, str], run_dir: Path) -> Iterator[dict[str, str]]:
    """This machine's warm process (hpc.rank.warm) for the ranks mpirun starts here, listening:
    the variables that hand each rank to it (a fork of one interpreter that imported torch once,
    instead of one interpreter and its imports per rank); none where it did not listen (the
    ranks start cold). It ends after them: its standard input closed, it waits for its forks.
    `run_dir` on its command line says whose it is (and its forks', the ranks: hpc.rankprocs)."""
    variables = {WARM_VARIABLE: secrets.token_hex(16), WARM_ADDRESS_VARIABLE: f"hpctk-warm.{os.getuid()}.local.{secrets.token_hex(8)}"}
    try:
        command = [sys.executable, "-u", "-m", "hpc.rank.warm", str(run_dir)]
        proc = subprocess.Popen(command, env={**env, **variables}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    except OSError as err:
        print(f"hpc-warm: not started ({err}): every rank starts its own interpreter", file=sys.stderr, flush=True)
        yield {}
        return
    try:
        listening = warm_listens(proc)
        if not listening:
            end_warm_process(proc)  # not importing torch beside the cold ranks, nor holding it until they end
        yield variables if listening else {}
    finally:
        end_warm_process(proc)


def warm_listens(proc: subprocess.Popen[str]) -> bool:
    """Whether the warm process said it listens (within WARM_LISTEN_S); what it says after that
    goes on to stderr if it is a failure (its import failed: the ranks start cold)."""
    stdout: IO[str] = proc.stdout  # type: ignore[assignment]  # a pipe: Popen(stdout=PIPE)
    ready, _, _ = select.select([stdout], [], [], WARM_LISTEN_S)
    first = stdout.readline() if ready else ""
    threading.Thread(target=say_warm_failures, args=(stdout,), daemon=True, name="hpc-warm-said").start()
    if first.startswith("hpc-warm: listening"):
        return True
    why = first.strip() or (f"hpc-warm: ended at once (exit code {exit_code(proc)})" if ready else f"hpc-warm: not listening after {WARM_LISTEN_S:.0f} s")
    print(why, "(every rank starts its own interpreter)", file=sys.stderr, flush=True)
    return False


def exit_code(proc: subprocess.Popen[str]) -> str:
    """The exit code of a process whose output ended (it may still be ending)."""
    try:
        return str(proc.wait(timeout=5))
    except subprocess.TimeoutExpired:
        return "none: it closed its output and runs"


def say_warm_failures(stdout: IO[str]) -> None:
    for line in stdout:
        if line.startswith("hpc-warm: failed"):
            print(line.strip(), "(the ranks start their own interpreters)", file=sys.stderr, flush=True)


def end_warm_process(proc: subprocess.Popen[str]) -> None:
    """Its standard input closed and SIGTERM: it ends once no fork of its lives (each went with its
    client, a rank of mpirun's), at once while it still imports (its standard input is read only
    after: mpirun that failed at once, or a second Ctrl-C, would wait for torch's import);
    SIGKILL after WARM_END_S."""
    with contextlib.suppress(OSError):
        proc.stdin.close()  # type: ignore[union-attr]  # a pipe: Popen(stdin=PIPE)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=WARM_END_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_exit_code(mpirun_code: int, run_dir: RunDir) -> int:
    """mpirun's code, or after a clean stop or an agreed failure (mpirun 0, the run's end record
    "stopped" or "failed": RunDir.read_result) the run's own."""
    if mpirun_code != 0:
        return mpirun_code
    result = run_dir.read_result()
    return int(result.get("exit_code", 0)) if result.get("status") in ("stopped", "failed") else 0


def main(argv: list[str]) -> int:
    from hpc.cli import Parser

    parser = Parser("python -m hpc.launching.ranks", __doc__ or "")
    parser.add_argument("--warm", action="store_true", help="fork the ranks from one warm process (cluster.warm_ranks): torch imported once")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (its result.json gives the exit code)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="MPIRUN_COMMAND...", help="mpirun and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the mpirun command after the run directory")
    try:
        hold_launch(Path(args.run_dir))  # one start at a time: not a second set of ranks beside the first
    except RunDirBusy as busy:
        print(f"error: {busy}", file=sys.stderr)
        return 2
    # never an enclosing job's warm process (launch.py typed in a Slurm job's batch script): this launch's, or none
    inherited = {name: value for name, value in os.environ.items() if name not in (WARM_VARIABLE, WARM_ADDRESS_VARIABLE)}
    env = {**with_local_rendezvous(inherited), RESULT_EXIT_VARIABLE: "1"}
    warm: contextlib.AbstractContextManager[dict[str, str]] = warm_process(env, Path(args.run_dir)) if args.warm else contextlib.nullcontext({})
    with warm as variables:
        code = run_ranks(args.command, {**env, **variables})
    return run_exit_code(code, RunDir(Path(args.run_dir)))


def with_local_rendezvous(env: Mapping[str, str], draw: Callable[[range], int] = random.choice) -> dict[str, str]:
    """`env` with the torch.distributed rendezvous of comm=gloo/nccl and of a user's script
    (rank 0's store) on a port free now: chosen here, at every start, so that command.txt
    resumes a run as launch.py started it; never one inherited from the shell (a torchrun's),
    which another run may hold. Outside the kernel's ephemeral range: a port bound to 0 and let
    go is the kernel's to hand out again, and mpirun's own listener (Open MPI's out-of-band
    channel) once took it. Rank 0 could not listen, and rank 1's store client connected to
    mpirun, which then waited on it for good (seen in a CI-like run: the job hung)."""
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port(draw))}


def free_port(draw: Callable[[range], int] = random.choice, tries: int = 64) -> int:
    """A port no socket holds now, from PORT_BASE up to the ephemeral range, where only explicit
    binds land; the kernel's choice (bind to 0) only if none of `tries` is free."""
    low, _ = ephemeral_ports()
    ports = range(PORT_BASE, max(low, PORT_BASE + 1))
    for _ in range(tries):
        port = draw(ports)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))  # where TCPStore listens: every address
            except OSError:
                continue
        return port
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def ephemeral_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's range for ports bound to 0 and for outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
