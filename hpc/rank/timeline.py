"""Rank 0's timeline of the run (`<run_dir>/timeline.jsonl`): a `stop` event when the ranks stop
on a signal, a `start` event after the first step of every start of the ranks, with the cost of
the interruption it recovered from (hpc.interruptions), which rank 0's log says in one line.

What the ranks cannot see themselves comes from files beside them: the step supervisor's records
(`<requests dir>/<id>.steps.jsonl`: the launch, a failure), the EXIT trap's requeue time
(`<id>.requeued-<start>`), and the scheduler's eligible and start times after a requeue."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc.env import REQUEST_DIR_VARIABLE, STEP_ATTEMPT_VARIABLE, batch_started, job_id, restart_count
from hpc.interruptions import TIMELINE, Cost, cost_of_interruption
from hpc.rank.scheduler import scheduler_of
from hpc.rundir import RunDir, read_jsonl
from trainers.faults import FAULTS

log = logging.getLogger("hpc.rank")


def append(path: Path, event: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(event) + "\n")


def best_effort(record: Callable[..., None], *args: Any) -> None:
    """Run `record`; a disk that is full or a record that was cut or edited costs the timeline
    entry (a warning), never the run."""
    try:
        record(*args)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        if not FAULTS.note(err, TIMELINE):  # a full disk: told once, by the run's end (trainers.faults)
            log.warning("interruption timeline not recorded: %s: %s", type(err).__name__, err)


class Timeline:
    """Where this start of the ranks stands: which start of the job, which restart inside its
    allocation, and the files that tell what came before."""

    def __init__(self, run_dir: RunDir, env: Mapping[str, str], process_started: float) -> None:
        self.path = run_dir.path / TIMELINE
        self.steps_file = run_dir.steps
        self.job_id = job_id(env)
        self.scheduler = scheduler_of(env)
        self.start = restart_count(env)
        self.attempt = int(env.get(STEP_ATTEMPT_VARIABLE) or 0)
        self.requests = Path(env[REQUEST_DIR_VARIABLE]) if env.get(REQUEST_DIR_VARIABLE) and self.job_id else None
        self.process_started = process_started
        self.batch_started = batch_started(env)

    def _request_file(self, suffix: str) -> Path | None:
        return self.requests / f"{self.job_id}.{suffix}" if self.requests is not None else None

    def supervisor_records(self) -> list[dict[str, Any]]:
        path = self._request_file("steps.jsonl")
        return read_jsonl(path) if path is not None else []

    def requeued_at(self, start: int) -> float | None:
        path = self._request_file(f"requeued-{start}")
        try:
            return float(path.read_text().split()[0]) if path is not None else None
        except (OSError, ValueError, IndexError):
            return None

    def record_stop(self, signal_name: str, received: float, phase: str | None, reason: str, stopped_step: int) -> None:
        """After the stop's checkpoint committed (or nothing was trained): rank 0 only. Best effort:
        the requeue that follows must happen whatever the disk or the records say."""
        best_effort(self._record_stop, signal_name, received, phase, reason, stopped_step)

    def record_start(self, milestones: dict[str, Any]) -> None:
        """After the first step of this start (trainers.context.Milestones): rank 0 only. Best effort:
        it runs inside the training loop."""
        best_effort(self._record_start, milestones)

    def _record_stop(self, signal_name: str, received: float, phase: str | None, reason: str, stopped_step: int) -> None:
        last = read_jsonl(self.steps_file)[-1:] if stopped_step else []
        agreed = float(last[0]["time"]) if last and int(last[0].get("step", -1)) == stopped_step else None
        if agreed is not None:
            received = min(received, agreed)  # the ranks agreed on a stop some rank had received by then
        event = {
            "event": "stop",
            "start": self.start,
            "attempt": self.attempt,
            "signal": signal_name,
            "received": received,
            "phase": phase,
            "reason": reason,
            "step": stopped_step,
            "agreed": agreed,
            "committed": time.time(),
        }
        append(self.path, event)

    def _record_start(self, milestones: dict[str, Any]) -> None:
        mine = [r for r in self.supervisor_records() if r.get("start") == self.start]
        launched = next((float(r["launched"]) for r in mine if r.get("attempt") == self.attempt), self.process_started)
        event: dict[str, Any] = {"event": "start", "start": self.start, "attempt": self.attempt, "launched": launched, **milestones}
        if self.job_id is not None and self.attempt == 0 and self.start > 0:
            event["eligible"], event["slurm_started"] = self.scheduler.queue_times()  # the key named for the first scheduler it came from
            # the batch script's first line: Slurm's launch of it is Slurm's, and StartTime is whole
            # seconds; one from before this start (inherited by a script that sets none) is not it
            batch = self.batch_started
            fresh = batch is not None and event["slurm_started"] is not None and batch >= event["slurm_started"]
            event["job_started"] = batch if fresh else event["slurm_started"]
        timeline = read_jsonl(self.path)
        previous = next((e for e in reversed(timeline) if e.get("event") == "start"), None)
        if previous is not None or self.start or self.attempt:
            cost = self._cost(event, previous, timeline)
            if cost is not None:
                event["cost"] = cost.as_dict()
                log.info("interruption cost: %s", cost.line())
        append(self.path, event)

    def _cost(self, event: dict[str, Any], previous: dict[str, Any] | None, timeline: list[dict[str, Any]]) -> Cost | None:
        """The interruption since the previous start event. Several stops in a row (a stop during
        start-up, before any first step) are one interruption, from the first of them."""
        since = float(previous["launched"]) if previous is not None else None
        stop = next((e for e in timeline if e.get("event") == "stop" and (since is None or float(e["received"]) >= since)), None)
        records = self.supervisor_records()
        failure: dict[str, Any] | None
        if stop is not None:  # its step's end, and the requeue that followed
            step = next((r for r in records if r.get("start") == stop.get("start") and r.get("attempt") == stop.get("attempt")), None)
            failure = {"ended": step.get("ended")} if step else None
            requeued = self.requeued_at(int(stop.get("start", self.start)))
        elif self.attempt > 0:  # restarted inside the allocation: the step before failed
            failure = next((r for r in records if r.get("start") == self.start and r.get("attempt") == self.attempt - 1), None)
            requeued = None
        else:  # requeued: the last step of the start before
            failure = next((r for r in reversed(records) if r.get("start") == self.start - 1), None)
            requeued = self.requeued_at(self.start - 1)
        how = "restart in the allocation" if self.attempt else "requeue" if previous is None or self.start > int(previous["start"]) else "a new launch"
        return cost_of_interruption(event, how, since, stop, failure, requeued, read_jsonl(self.steps_file))
