"""What each interruption of a run cost, end to end, from what the run left behind.

Rank 0 appends to `<run_dir>/timeline.jsonl`:
- a `stop` event when the ranks stopped on a signal: when it was received, when the ranks
  agreed on the stop (the time of the last step), when the checkpoint committed;
- a `start` event once the first step of a start of the ranks is done: launched (the step
  supervisor's launch, else the process start), when model, data and checkpoint were ready, how
  long the checkpoint took to read, the first step, and, after a requeue, Slurm's EligibleTime
  and StartTime. With it goes the breakdown of the interruption it recovered from (`cost`).

Failures leave no stop event (the rank is gone); their time and cause come from the step
supervisor's records (hpc.slurm.supervise), and the requeue time from the EXIT trap
(`<id>.requeued-<start>`). Pure functions; a leaf (standard library only).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

TIMELINE = "timeline.jsonl"


@dataclass(frozen=True)
class Cost:
    """One interruption, in seconds from its cause to the first step after it."""

    cause: str
    how: str  # "restart in the allocation" or "requeue"
    to_stop_s: float | None  # signal -> the ranks agreed on a step (None: a failure, no stop)
    to_commit_s: float | None  # agreed -> checkpoint committed
    to_exit_s: float | None  # committed (or the failure) -> the step ended
    relaunch_s: float | None  # step ended -> next launch, Slurm's hold and queue wait excluded
    held_s: float | None  # requeue -> eligible again (Slurm's requeue hold)
    queued_s: float | None  # eligible -> the batch script's first line (Slurm's StartTime where it set no clock)
    start_up_s: float  # launch -> model and data ready, checkpoint not yet read
    load_s: float  # reading the checkpoint
    first_step_s: float  # checkpoint loaded -> first step done
    total_s: float  # cause -> first step done
    redone_steps: int
    redone_s: float  # the redone steps at the run's median step time

    def line(self) -> str:
        parts = [
            f"{name} {value:.1f} s"
            for name, value in (
                ("signal->stop", self.to_stop_s),
                ("->commit", self.to_commit_s),
                ("->exit", self.to_exit_s),
                ("->relaunch", self.relaunch_s),
                ("held", self.held_s),
                ("queued", self.queued_s),
                ("start-up", self.start_up_s),
                ("load", self.load_s),
                ("first step", self.first_step_s),
            )
            if value is not None
        ]
        return f"{self.cause}, {self.how}: {', '.join(parts)}; {self.total_s:.1f} s in all, {self.redone_steps} steps redone ({self.redone_s:.1f} s)"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def cost_of_interruption(
    start: Mapping[str, Any],
    how: str,
    previous_launch: float | None,
    stop: Mapping[str, Any] | None,
    failure: Mapping[str, Any] | None,
    requeued_at: float | None,
    steps: Sequence[Mapping[str, Any]],
) -> Cost | None:
    """The interruption that `start` (a start event, not the first) recovered from, by `how`
    ("restart in the allocation", "requeue", "a new launch"). `stop`: the
    stop event of the start before, if it stopped on a signal; `failure`: the supervisor's record
    of the step before, if it failed; `steps`: the run's step rows as logged so far (with this
    start's first step). None when nothing tells when the interruption began."""
    launched = float(start["launched"])
    before = [row for row in steps if float(row["time"]) < launched and (previous_launch is None or float(row["time"]) >= previous_launch)]
    last_step_at = max((float(row["time"]) for row in before), default=None)
    onset = interruption_onset(stop, failure, last_step_at)
    if onset is None:
        return None
    began, cause, settled, to_stop, to_commit = onset
    ended = _number(failure.get("ended")) if failure else None
    to_exit = max(ended - settled, 0.0) if ended is not None else None
    eligible, job_started = _number(start.get("eligible")), _number(start.get("job_started"))
    held = queued = None
    if how == "requeue" and requeued_at is not None:
        held = max(eligible - requeued_at, 0.0) if eligible is not None else None
        queued = max(job_started - eligible, 0.0) if eligible is not None and job_started is not None else None
    waited = (held or 0.0) + (queued or 0.0)
    relaunch = max(launched - (ended if ended is not None else settled) - waited, 0.0)
    loaded, load_s, first_step = float(start["loaded"]), float(start["load_s"]), float(start["first_step"])
    reached = max((int(row["step"]) for row in before), default=0)
    resumed_from = int(start.get("resumed_from") or 0)
    redone = max(reached - resumed_from, 0)
    median_step_s = statistics.median(float(row["step_ms"]) / 1000 for row in steps) if steps else 0.0
    return Cost(
        cause=cause,
        how=how,
        to_stop_s=to_stop,
        to_commit_s=to_commit,
        to_exit_s=to_exit,
        relaunch_s=relaunch,
        held_s=held,
        queued_s=queued,
        start_up_s=max(loaded - load_s - launched, 0.0),
        load_s=load_s,
        first_step_s=max(first_step - loaded, 0.0),
        total_s=max(first_step - began, 0.0),
        redone_steps=redone,
        redone_s=redone * median_step_s,
    )


def interruption_onset(
    stop: Mapping[str, Any] | None, failure: Mapping[str, Any] | None, last_step_at: float | None
) -> tuple[float, str, float, float | None, float | None] | None:
    """When the interruption began, its cause in words, when the ranks had settled (the stop's
    commit, else the failure), and for a stop the seconds to agree on a step and to commit it.
    None when nothing tells when it began."""
    if stop is not None:
        began = float(stop["received"])
        cause = f"{stop['signal']} ({stop.get('reason') or 'a stop'}{', during ' + stop['phase'] if stop.get('phase') not in (None, 'training') else ''})"
        agreed, committed = _number(stop.get("agreed")), float(stop["committed"])
        if agreed is None:
            return began, cause, committed, None, None
        return began, cause, committed, max(agreed - began, 0.0), max(committed - agreed, 0.0)
    if failure is not None and _number(failure.get("failed")) is not None:
        began = float(failure["failed"])
        return began, f"failure ({failure.get('failure') or 'srun exit ' + str(failure.get('exit_code'))})", began, None, None
    if last_step_at is not None:
        return last_step_at, "failure (cause unknown: no record)", last_step_at, None, None
    return None


def costs(timeline: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every interruption's cost as rank 0 recorded it in the timeline (its start events' `cost`)."""
    return [dict(event["cost"]) for event in timeline if event.get("event") == "start" and isinstance(event.get("cost"), dict)]


def restarts_in(timeline: Sequence[Mapping[str, Any]]) -> int:
    """How often the ranks were started again, by rank 0's start events (one after the first step
    of every start): a local relaunch and a restart inside an allocation count as a requeue does."""
    return max(sum(1 for event in timeline if event.get("event") == "start") - 1, 0)


def total_line(timeline: Sequence[Mapping[str, Any]]) -> str | None:
    """`3 interruptions: 2m10s from cause to resumed step (held 2m00s, queued 3s), 4 steps redone`; None without any."""
    found = costs(timeline)
    if not found:
        return None
    total = sum(float(c["total_s"]) for c in found)
    held = sum(float(c["held_s"] or 0) for c in found)
    queued = sum(float(c["queued_s"] or 0) for c in found)
    redone = sum(int(c["redone_steps"]) for c in found)
    waits = f" (Slurm's hold {duration(held)}, queued {duration(queued)})" if held or queued else ""
    return f"{len(found)} interruption{'s' if len(found) != 1 else ''}: {duration(total)} from cause to resumed step{waits}, {redone} steps redone"


def duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"
