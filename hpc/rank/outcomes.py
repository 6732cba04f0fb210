"""How each rank's part of a run ended, agreed before anyone says the run completed.

A run completed only when every rank did. A user's script gives no collective at its end (it may
have torn its process group down), so each rank leaves a line in the run dir as it ends:
`outcomes/rank-<n>.json`, `completed` or `failed` with the error; rank 0 writes result.json's
`completed` only once every rank of this start has said so. A rank that fails writes result.json
itself (`status: failed`, its rank, the error's type and message) before the job is ended, so a
failure on any rank, rank 0 having returned or not, is never reported as success (issue 46: when
only rank 1 raised, result.json said completed and a sweep counted the point a success).
A marker carries its process's start time: rank 0 counts those of processes started with its
own (within START_SKEW_S), never an earlier start's left in a resumed run dir.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc.rundir import RunDir

log = logging.getLogger(__name__)

POLL_S = 0.05  # the peers' markers: no event to wait on across processes (and nodes)
START_SKEW_S = 2.0  # the ranks of one start begin within this of each other (mpirun, srun); a start's imports alone take longer


def marker(run_dir: RunDir, rank: int) -> Path:
    return run_dir.outcomes / f"rank-{rank}.json"


def error_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0] if str(err) else type(err).__name__


def record_failure(run_dir: RunDir, rank: int, world_size: int, started: float, err: BaseException, summary: dict[str, Any] | None = None) -> None:
    """This rank (its process started at `started`) failed: its marker, and result.json saying so
    (the job ends next). Never raises: the caller ends the job next, and a full disk (the failure
    itself, maybe) must not keep it from that."""
    line = error_line(err)
    result = {**(summary or {}), "status": "failed", "finished": False, "exit_code": 1, "failed_rank": rank, "error": line, "world_size": world_size}
    try:
        marker(run_dir, rank).parent.mkdir(parents=True, exist_ok=True)
        run_dir.write_json(marker(run_dir, rank), {"status": "failed", "error": line, "started": started})
    except OSError:
        pass  # a full or read-only disk: result.json below finds a place where it can (RunDir.write_result)
    if run_dir.write_result(result) is None:
        log.warning("could not record the failure anywhere: %s and this machine's %s refused it", run_dir.path, run_dir.end_fallback.parent)


def forget_end(run_dir: RunDir, rank: int) -> None:
    """Before this rank's script runs: the word it left at an earlier start is gone. A start
    resumed at once (a quick stop, a fast machine) may begin within START_SKEW_S of the last,
    and rank 0 would take that word for this start's (a stop for a script that completed)."""
    marker(run_dir, rank).unlink(missing_ok=True)


def record_end(run_dir: RunDir, rank: int, started: float, status: str) -> None:
    """This rank's script returned: `completed`, or `stopped` (a signal, or its exit code 75)."""
    marker(run_dir, rank).parent.mkdir(parents=True, exist_ok=True)
    run_dir.write_json(marker(run_dir, rank), {"status": status, "started": started})


def wait_for_peers(run_dir: RunDir, world_size: int, started: float, sleep: Callable[[float], None] = time.sleep) -> tuple[int, str, str] | None:
    """Rank 0 (its process started at `started`), its own part completed: wait until every rank
    of this start has said how it ended. None: all completed; else (rank, status, error) of the
    first that did not, a failure before a stop. A rank that dies without a word ends the job
    through mpirun or srun, and this wait with it."""
    while True:
        said = peers_said(run_dir, world_size, started)
        if len(said) == world_size or any(found.get("status") == "failed" for found in said.values()):
            others = sorted(
                (found.get("status") != "failed", rank, str(found.get("status")), str(found.get("error", "")))
                for rank, found in said.items()
                if found.get("status") != "completed"
            )
            return (others[0][1], others[0][2], others[0][3]) if others else None
        sleep(POLL_S)


def peers_said(run_dir: RunDir, world_size: int, started: float) -> dict[int, dict[str, Any]]:
    """The markers the ranks of this start (begun with `started`) have left so far, by rank."""
    said: dict[int, dict[str, Any]] = {}
    for rank in range(world_size):
        try:
            found = json.loads(marker(run_dir, rank).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(found, dict) and isinstance(found.get("started"), int | float) and found["started"] >= started - START_SKEW_S:
            said[rank] = found
    return said


def failed_peer(run_dir: RunDir, world_size: int, started: float) -> tuple[int, str] | None:
    """(rank, error) of a rank of this start that has failed, now, without waiting; None: none
    has. Rank 0 stopped by a signal asks: the launcher ending the job after a peer's failure
    (mpirun's SIGTERM) is no stop to resume from."""
    failed = sorted((rank, str(found.get("error", ""))) for rank, found in peers_said(run_dir, world_size, started).items() if found.get("status") == "failed")
    return failed[0] if failed else None
