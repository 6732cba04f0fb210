"""Stop signals caught from a rank's first instruction: never lost, never killing the rank.

Slurm may signal a job at any moment (preemption, the time limit), also while its ranks still
import Python and torch. A signal whose handler is not installed yet takes its default action:
SIGUSR1, SIGUSR2 and SIGTERM terminate the rank. So the rank's first module (hpc.rank.main,
under srun and mpirun alike) catches them before anything else is imported, and hands what was
caught to the training's stop flag. Standard library only.
"""

from __future__ import annotations

import faulthandler
import signal
import time

# Every signal cluster.signal accepts (hpc.config.validate), plus Ctrl-C under mpirun.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
PROCESS_STARTED = time.time()  # the rank's first module: about when the process started (hpc.rank.timeline)
_caught: list[tuple[str, float]] = []


def _note(signum: int, frame: object) -> None:
    if not _caught:  # the first signal says why we stop
        _caught.append((signal.Signals(signum).name, time.time()))


def catch_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note)


def report_fatal_signals() -> None:
    """A rank that dies of SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT first prints every
    thread's Python stack to its stderr (the job's log): in which call of the user's code, of
    torch or of MPI it died, where otherwise only a native frame or nothing is shown. The rank
    still dies of the signal (exit 139 for SIGSEGV), as before. Open MPI keeps a handler that is
    already installed."""
    faulthandler.enable(all_threads=True)


def process_started() -> float:
    """About when this rank's process started: read at the call, as a fork of a warm process
    (hpc.rank.warm) sets it to its client's start after these modules were imported."""
    return PROCESS_STARTED


def forget_caught() -> None:
    """A parked rank's next run (hpc.rank.parking): what its last run caught was that run's."""
    _caught.clear()


def caught_early() -> tuple[str, float] | None:
    """The first stop signal caught before training installed its own flag: (name, when)."""
    return _caught[0] if _caught else None
