"""The step watchdog: a job whose steps stopped ends now, not at its time limit.

A rank that dies or stalls inside a collective leaves every other rank blocked in the same
collective, where no exception ever comes. Each rank runs a thread that watches the time since
its last finished step; past the timeout it names the rank that stalled and calls `on_stall`
with a one-line message, which ends the job (see hpc.rank.main). The heartbeats live in the run dir,
on the file system every rank shares. The timeout must exceed the longest stretch between steps:
evaluation, a synchronous checkpoint. Start-up to the first step (imports, MPI or NCCL init,
loading data, model and checkpoint) has its own, longer allowance, `startup_s`.

Who stalled: every rank's watchdog thread rewrites a heartbeat file (step, host, pid, time) each
poll, so a rank that is stopped, dead or stuck in the kernel goes silent while the ranks merely
waiting for it in a collective stay fresh. Failing that, the ranks at the lowest step are named.
The first rank to decide writes the verdict to VERDICT_FILE; ranks that fire later report that
one (by then the launcher may already be waking and killing the stalled rank, which would make
it look alive again).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainers.faults import FAULTS

log = logging.getLogger("trainers.watchdog")

VERDICT_FILE = "stall.json"


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    step: int
    host: str
    pid: int
    time: float  # when its watchdog thread last wrote (wall clock: comparable between nodes)
    left: str | None = None  # what took the rank out of the steps the others wait in (a run handle's finish())


def heartbeat_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.json"


def read_heartbeats(directory: Path) -> list[Heartbeat]:
    beats = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            beats.append(Heartbeat(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # a file being replaced: its rank shows up as missing
    return beats


def describe_stall(beats: list[Heartbeat], world_size: int, now: float, silent_after_s: float) -> str:
    """Who holds the job up: ranks silent for `silent_after_s` (stopped, dead), else the ranks at
    the lowest step; and ranks never heard of."""
    heard = {b.rank for b in beats}
    missing = [r for r in range(world_size) if r not in heard]
    silent = [b for b in beats if now - b.time > silent_after_s]
    lowest = min((b.step for b in beats), default=0)
    gone = [b for b in beats if b.left]
    if gone:
        named = [f"rank {b.rank} on {b.host} (pid {b.pid}) {b.left} after step {b.step}" for b in gone]
    elif silent:
        # No step named: a heartbeat is written once per poll, so its step may be several steps old.
        named = [f"rank {b.rank} on {b.host} (pid {b.pid}) silent for {now - b.time:.0f} s" for b in silent]
    else:
        named = [f"rank {b.rank} on {b.host} (pid {b.pid}) at step {b.step}" for b in beats if b.step == lowest]
    parts = ["; ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")] if named else []
    if missing:
        parts.append(f"never reported: {_ranks(missing)}")
    return "; ".join(parts) or "every rank alive and at the same step"


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return f"ranks {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


class Watchdog:
    def __init__(
        self,
        timeout_s: float,
        directory: Path | None,
        rank: int,
        world_size: int,
        host: str,
        on_stall: Callable[[str], None],
        poll_s: float | None = None,
        startup_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.startup_s = max(timeout_s, startup_s)
        self._directory, self._rank, self._world_size, self._host = directory, rank, world_size, host
        self._on_stall = on_stall
        self._poll_s = poll_s if poll_s is not None else min(5.0, timeout_s / 4)
        self._clock = clock  # injectable: tests decide what time it is, whatever the machine's load
        self._last_beat = clock()
        self._started_at = time.time()  # wall clock, as in verdict files written by other nodes
        self._step = 0
        self._stepped = False  # no step finished yet: the start-up allowance applies
        self._left: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def start(self) -> Watchdog:
        self._started_at = time.time()
        self._write()
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """A step finished (called by fit at every step boundary)."""
        self._last_beat, self._step, self._stepped = self._clock(), step, True

    def leave(self, why: str) -> None:
        """This rank takes no more steps (`why`): a stall of the others names it."""
        self._left = why
        self._write()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _write(self) -> None:
        if self._directory is None:
            return
        now = time.time()
        path = heartbeat_file(self._directory, self._rank)
        tmp = path.with_suffix(".tmp")
        try:
            beat = {"rank": self._rank, "step": self._step, "host": self._host, "pid": os.getpid(), "time": now}
            tmp.write_text(json.dumps({**beat, "left": self._left} if self._left else beat))
            tmp.replace(path)
        except OSError as err:  # a full or read-only disk: the step vote ends the run (trainers.faults), told once
            if not FAULTS.note(err, tmp):
                log.warning("heartbeat not written: %s", err)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            message = self.check()
            if message is not None:
                self._on_stall(message)
                return

    def check(self) -> str | None:
        """One poll: rewrite this rank's heartbeat; past the timeout, the stall message."""
        self._write()
        silent = self._clock() - self._last_beat
        if silent <= (self.timeout_s if self._stepped else self.startup_s):
            return None
        waited = (
            f"no step finished for {silent:.0f} s (timeout {self.timeout_s:g} s) after step {self._step}"
            if self._stepped
            else f"no first step after {silent:.0f} s of start-up (timeout {self.startup_s:g} s)"
        )
        return f"watchdog: {waited}; behind: {self._verdict()}"

    def _verdict(self) -> str:
        if self._directory is None:
            return "unknown (no heartbeat directory)"
        beats = read_heartbeats(self._directory)
        mine = describe_stall(beats, self._world_size, time.time(), silent_after_s=2 * self._poll_s + 0.5)  # alive ranks write every poll
        path = self._directory / VERDICT_FILE
        try:
            with open(path, "x") as f:  # exclusive: the first rank's verdict is the job's
                json.dump({"rank": self._rank, "verdict": mine, "time": time.time()}, f)
            return mine
        except FileExistsError:
            try:
                earlier = json.loads(path.read_text())
            except (OSError, ValueError):
                return mine
            if earlier.get("time", 0) < self._started_at:  # left by an earlier run of this job
                path.unlink(missing_ok=True)
                return self._verdict()
            return f"{earlier['verdict']} (found by rank {earlier['rank']})"
        except OSError:
            return mine
