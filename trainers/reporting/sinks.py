"""Where rank 0's figures go: one protocol (`MetricsSink`) that the built-in loop, the run handle
and the framework adapters all feed through trainers.reporting.reporter.StepReporter, and the
sinks that need no account: the run dir's own files (RunFiles: steps.jsonl, metrics.jsonl),
TensorBoard's event files and a Prometheus text file. The experiment trackers (MLflow, Weights &
Biases) are trainers/reporting/trackers.py; the terminal's line is the reporter's own.

Two kinds of record, each written to one file by one sink (RunFiles): a training step's (`step`:
steps.jsonl) and a moment's (`moment`: metrics.jsonl: an epoch's end, a validation, the held-out
test, a script's log(), the peak memory at the end). A plotting sink takes from a record what it
plots (`scalars`, `moment_scalars`), so every sink names a figure the same way. A sink is handed
every figure already reduced over ranks, on rank 0 only; its library is imported when the sink is
built, i.e. only when the job chose it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from trainers.reporting.metrics import MetricsWriter

PHASES = ("data", "compute", "comm", "optimizer")  # the step time split, in fit()'s order
MOMENTS_FILE = "metrics.jsonl"  # beside steps.jsonl

# What the loop records about every step itself (MetricsWriter adds "time"); every other number in
# a record is a task's metric.
BOOKKEEPING = {
    "time", "step", "epoch", "loss", "samples_per_s", "tokens_per_s", "step_ms", "bad_steps", "rollbacks", "skipped", "samples", "tokens", "lr", "grad_norm",
    *(f"{p}_ms" for p in PHASES),
}  # fmt: skip
MOMENT_PLACE = {"time", "step", "epoch", "world_size"}  # where a moment is, not what it measured
SPLIT_PREFIXES = {"val_": "val/", "test_": "test/"}  # a split's figures, as every plotting sink names them


def task_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The task's metrics in a step record (means per sample over ranks), by name."""
    return {key: float(value) for key, value in record.items() if key not in BOOKKEEPING and _number(value)}


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A step record's plottable numbers as every plotting sink names them (train/<name>): the
    loss, the task's metrics, throughput, the learning rate, the gradient norm and the step's
    time by phase (no counters, no flags)."""
    keys = ("loss", *task_metrics(record), "samples_per_s", "tokens_per_s", "lr", "grad_norm", "step_ms", *(f"{p}_ms" for p in PHASES))
    return {f"train/{key}": float(record[key]) for key in keys if key in record}


def moment_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A moment record's plottable numbers as every plotting sink names them: a split's figures
    as val/<name> and test/<name>, the rest (an epoch's loss and throughput, what a script
    logged) by their own names; finite numbers only (no per-rank lists, no flags)."""
    plotted = {}
    for key, value in record.items():
        if key in MOMENT_PLACE or not _number(value) or not math.isfinite(value):
            continue
        prefix = next((p for p in SPLIT_PREFIXES if key.startswith(p)), "")
        plotted[SPLIT_PREFIXES[prefix] + key.removeprefix(prefix) if prefix else key] = float(value)
    return plotted


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class MetricsSink(Protocol):
    """One destination of a run's figures. `step`: a training step's record (with "step");
    `moment`: a moment's record (with "step": an epoch's end, a validation, the held-out test, a
    script's log()); `config`: the composed job, once per start; `close`: the run's end on this
    start ("FINISHED", "STOPPED": stopped to resume later, "FAILED")."""

    def step(self, record: Mapping[str, Any]) -> None: ...

    def moment(self, record: Mapping[str, Any]) -> None: ...

    def config(self, config: Mapping[str, Any]) -> None: ...

    def close(self, status: str) -> None: ...


class RunFiles:
    """The run dir's record of its figures, the one writer of each file: steps.jsonl, every step's
    record, and metrics.jsonl beside it, every moment's; both appended (a requeued job keeps
    appending). hpc.status, hpc.report and the resume verifier read them, and a tracker that
    lost what it was given is given it again from them (trainers/reporting/trackers.py)."""

    def __init__(self, steps_file: Path) -> None:
        self._steps = MetricsWriter(steps_file)
        self._moments = MetricsWriter(steps_file.with_name(MOMENTS_FILE))

    def step(self, record: Mapping[str, Any]) -> None:
        self._steps.write(dict(record))

    def moment(self, record: Mapping[str, Any]) -> None:
        self._moments.write(dict(record))

    def config(self, config: Mapping[str, Any]) -> None:
        pass  # config.yaml has it

    def close(self, status: str) -> None:
        self._steps.close()
        self._moments.close()


class TensorBoardSink:
    """Event files (torch.utils.tensorboard; needs the tensorboard package, checked before
    submission): train/<name> per step, each figure under its own tag."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(directory))

    def step(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, step)

    def moment(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in moment_scalars(record).items():
            self._writer.add_scalar(tag, value, step)

    def config(self, config: Mapping[str, Any]) -> None:
        pass

    def close(self, status: str) -> None:
        self._writer.close()


class PrometheusFile:
    """A Prometheus text file for node_exporter's textfile collector, written through
    prometheus_client (its writer replaces the file whole: the collector never reads half of it)
    every `every` steps and at the end."""

    def __init__(self, path: Path, run: str, every: int = 1) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.path, self._every = path, max(1, every)
        self.registry = CollectorRegistry()

        def gauge(name: str, text: str, *labels: str) -> Any:
            return Gauge(name, text, ["run", *labels], registry=self.registry)

        # a child per label set is made at its first value: a figure never reported is not exported as 0
        self._gauges = {
            "step": gauge("hpctk_step", "optimizer steps done"),
            "samples_per_s": gauge("hpctk_samples_per_second", "training throughput, all ranks"),
            "loss": gauge("hpctk_loss", "training loss, mean over ranks"),
            "accuracy": gauge("hpctk_accuracy", "training accuracy, mean over ranks"),
        }
        self._metric = gauge("hpctk_metric", "a task's training metric, mean over ranks", "name")
        self._phase = gauge("hpctk_step_phase_seconds", "step time by phase, mean over ranks", "phase")
        self._run = run
        self._stepped = False

    def step(self, record: Mapping[str, Any]) -> None:
        self._stepped = True
        for key, gauge in self._gauges.items():
            if key in record:
                gauge.labels(run=self._run).set(float(record[key]))
        for name, value in task_metrics(record).items():
            if name != "accuracy":
                self._metric.labels(run=self._run, name=name).set(value)
        for phase in PHASES:
            self._phase.labels(run=self._run, phase=phase).set(float(record.get(f"{phase}_ms", 0.0)) / 1000)
        if int(record["step"]) % self._every == 0:
            self.write()

    def write(self) -> None:
        from prometheus_client import write_to_textfile

        write_to_textfile(str(self.path), self.registry)

    def moment(self, record: Mapping[str, Any]) -> None:
        pass

    def config(self, config: Mapping[str, Any]) -> None:
        pass

    def close(self, status: str) -> None:
        if self._stepped:
            self.write()  # the last step's figures, whatever the interval
