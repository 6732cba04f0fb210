"""Waiting on MPI requests without holding a core.

Open MPI's blocking calls spin in its progress loop (with sched_yield in between under
mpi_yield_when_idle): a rank waiting for a peer (one still importing torch at the start, rank 0
writing a checkpoint, a stalled or lost rank until the watchdog or Slurm acts) keeps a core at
100% that the node's other ranks and data-loader workers need. Where a node has fewer cores than
ranks (the CPU mode, the simulated cluster, a shared node) that wait slows the very rank it
waits for. So the engine's messages are non-blocking and waited on here: polled without a pause
for SPIN_S, within which a step of a collective on a fast link completes, then between sleeps of
a twentieth of the time waited so far (at most MAX_SLEEP_S): a long wait costs a few hundred
wake-ups a second, and a wait's end is noticed at most about 5% (or 60 us of timer slack) late."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

SPIN_S = 0.002
SLEEP_FRACTION = 0.05
MAX_SLEEP_S = 0.005


def wait_all(requests: Sequence[Any]) -> None:
    """Return once every mpi4py request in `requests` has completed (MPI errors raise, as from
    the blocking calls)."""
    from mpi4py import MPI  # imported here: collectives.algorithms imports without MPI

    pending = list(requests)
    started = time.perf_counter()
    while not MPI.Request.Testall(pending):
        waited = time.perf_counter() - started
        if waited >= SPIN_S:
            time.sleep(min(waited * SLEEP_FRACTION, MAX_SLEEP_S))
