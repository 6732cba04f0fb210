"""Reporting on rank 0: the progress line (tqdm's bar on a terminal, timestamped lines in a log),
and every metrics sink: the run dir's files, always, and the chosen ones (trainers/reporting/sinks.py:
TensorBoard, Prometheus; trainers/reporting/trackers.py: MLflow, W&B), each given every step's
record and every moment's. Every figure it gets is already reduced over ranks.

Also the straggler rule: from every rank's mean busy time per step, the slowest vs the median.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from trainers.faults import refused_writes_noted
from trainers.reporting.sinks import PHASES, MetricsSink, RunFiles, task_metrics

__all__ = ["PHASES", "StepReporter", "Straggler", "find_straggler", "four_places", "task_metrics"]
progress_log = logging.getLogger("trainers.progress")  # a terminal shows these as the bar instead
# The step's own line first (it names the step: "step 30/480  loss ..."), then tqdm's bar and times
BAR_FORMAT = "{desc}  {bar:12} {percentage:3.0f}% [{elapsed}<{remaining}]"


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    step_ms: float
    median_ms: float

    @property
    def ratio(self) -> float:
        return self.step_ms / self.median_ms if self.median_ms > 0 else float("inf")

    def line(self) -> str:
        return f"straggler: rank {self.rank} on {self.host} takes {self.step_ms:.1f} ms per step, {self.ratio:.2f}x the median {self.median_ms:.1f} ms"


def find_straggler(step_ms: list[float], hosts: list[str], ratio: float) -> Straggler | None:
    """The slowest rank when its step time is above `ratio` x the median; None otherwise."""
    if len(step_ms) < 2:
        return None
    median = statistics.median(step_ms)
    slowest = max(range(len(step_ms)), key=step_ms.__getitem__)
    found = Straggler(slowest, hosts[slowest] if slowest < len(hosts) else "?", step_ms[slowest], median)
    return found if found.ratio > ratio else None


SHORT_NAMES = {"accuracy": "acc"}  # in the progress line


def four_places(value: float) -> str:
    """A loss or metric to four decimal places, but never a non-zero value shown as 0.0000:
    below 0.001 (a loss of 1.6e-05 late in training) in three significant digits."""
    return f"{value:.3g}" if value != 0 and abs(value) < 1e-3 else f"{value:.4f}"


class StepReporter:
    """Rank 0 reports; on other ranks (`steps_file=None`) every method does nothing. The sinks:
    the run dir's files (steps.jsonl and metrics.jsonl beside it), then `sinks` (the chosen ones:
    trainers.reporting.trackers.opened_sinks)."""

    def __init__(
        self,
        steps_file: Path | None,
        total_steps: int | None = None,
        log_every: int = 10,
        terminal: TextIO | None = None,
        sinks: Sequence[MetricsSink] = (),
        columns: int = 120,
    ) -> None:
        self.enabled = steps_file is not None
        self.total_steps = total_steps
        self._log_every = max(1, log_every)
        self._terminal = terminal if self.enabled else None  # the caller knows whether a person watches
        self._bar: Any = None  # tqdm's, made at the first step (the total is known by then)
        self._columns = columns  # the terminal's width: a longer line is cut, never wrapped
        self.sinks: list[MetricsSink] = [RunFiles(steps_file), *sinks] if steps_file is not None else []
        self.trackers: dict[str, str] = {}  # each tracker's state once closed: "complete", or why not

    def report(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        for sink in self.sinks:
            with refused_writes_noted(None):  # a full disk: the step vote ends the run (trainers.faults)
                sink.step(record)
        step = int(record["step"])
        if self._terminal is not None:
            self._draw(step, record)
        if step % self._log_every == 0 or step == self.total_steps:
            progress_log.info("%s", self._progress_text(record))

    def _draw(self, step: int, record: dict[str, Any]) -> None:
        """tqdm's bar: the step's line, then the bar, the share done and the time left. Log lines
        go through tqdm.write (hpc.rank.main), which lifts the bar and draws it again below them."""
        text = self._progress_text(record)
        if self._bar is None:
            from tqdm import tqdm

            tqdm.monitor_interval = 0  # no monitor thread: the data loader's workers fork this process
            # From the step a resume starts at; redrawn at most 10 times a second (tqdm's default)
            self._bar = tqdm(total=self.total_steps, initial=step, desc=text, file=self._terminal, ncols=self._columns, bar_format=BAR_FORMAT)
        self._bar.set_description_str(text, refresh=False)
        self._bar.update(step - self._bar.n)

    def _progress_text(self, record: dict[str, Any]) -> str:
        of = f"/{self.total_steps}" if self.total_steps else ""
        if "compute_ms" not in record:  # a script's step (hpc.run): its own metrics and the step's time
            own = "".join(f"{name} {value:.4g}  " for name, value in task_metrics(record).items())
            loss = f"loss {four_places(record['loss'])}  " if "loss" in record else ""  # a GAN's losses have names of their own
            rates = "".join(f"  {record[k]:.0f} {k.removesuffix('_per_s')}/s" for k in ("samples_per_s", "tokens_per_s") if k in record)
            return f"step {record['step']}{of}  {loss}{own}{record.get('step_ms', 0.0):.1f} ms/step{rates}"
        metrics = "".join(f"{SHORT_NAMES.get(name, name)} {value:.3f}  " for name, value in task_metrics(record).items())
        split = " ".join(f"{p} {record.get(f'{p}_ms', 0.0):.1f}" for p in PHASES)
        optimizer = (f"lr {record['lr']:.3g}  " if "lr" in record else "") + (f"grad-norm {record['grad_norm']:.3g}  " if "grad_norm" in record else "")
        loss = four_places(record.get("loss", float("nan")))
        return f"step {record['step']}{of}  loss {loss}  {metrics}{optimizer}{record['samples_per_s']:.0f} samples/s  ms: {split}"

    def moment(self, record: Mapping[str, Any]) -> None:
        """A moment's record (with "step": an epoch's end, a validation, the held-out test, a
        script's log()), for every sink: metrics.jsonl keeps it whole, the plotting sinks plot it."""
        if not self.enabled:
            return
        for sink in self.sinks:
            with refused_writes_noted(None):
                sink.moment(record)

    def config(self, config: Mapping[str, Any]) -> None:
        """The composed job, once per start (the trackers record it)."""
        for sink in self.sinks:
            with refused_writes_noted(None):
                sink.config(config)

    def close(self, status: str = "FINISHED") -> None:
        """`status`: how this start ends: FINISHED, STOPPED (to resume later) or FAILED. The run
        dir's files still take a moment after it (a script's log() after finish(): the file is
        opened again); the other sinks are done."""
        if self._bar is not None:
            self._bar.close()  # the last step's line stays on the screen
        self._bar = self._terminal = None
        sinks, self.sinks = self.sinks, [sink for sink in self.sinks if isinstance(sink, RunFiles)]
        for sink in sinks:
            with refused_writes_noted(None):
                sink.close(status)
        self.trackers = {getattr(sink, "name", "?"): getattr(sink, "state", "") for sink in sinks if hasattr(sink, "state")}  # for result.json
