"""Per-step reporting on rank 0: steps.jsonl, a progress bar or timestamped lines, a Prometheus
text file, TensorBoard. Every figure it gets is already reduced over ranks by fit().

Also the straggler rule: from every rank's mean busy time per step, the slowest vs the median.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from trainers.metrics import MetricsWriter

PHASES = ("data", "compute", "comm", "optimizer")  # the step time split, in fit()'s order
progress_log = logging.getLogger("trainers.progress")  # a terminal shows these as the bar instead


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


# What the loop records about every step itself (MetricsWriter adds "time"); every other number in
# a record is a task's metric.
BOOKKEEPING = {
    "time", "step", "epoch", "loss", "samples_per_s", "tokens_per_s", "step_ms", "bad_steps", "rollbacks", "skipped", "samples", "tokens", "lr", "grad_norm",
    *(f"{p}_ms" for p in PHASES),
}  # fmt: skip
SHORT_NAMES = {"accuracy": "acc"}  # in the progress line


def four_places(value: float) -> str:
    """A loss or metric to four decimal places, but never a non-zero value shown as 0.0000:
    below 0.001 (a loss of 1.6e-05 late in training) in three significant digits."""
    return f"{value:.3g}" if value != 0 and abs(value) < 1e-3 else f"{value:.4f}"


def task_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The task's metrics in a step record (means per sample over ranks), by name."""
    return {key: float(value) for key, value in record.items() if key not in BOOKKEEPING and isinstance(value, int | float) and not isinstance(value, bool)}


def render_prometheus(record: dict[str, Any], run: str) -> str:
    """Prometheus text exposition format (for node_exporter's textfile collector)."""
    label = run.replace("\\", "\\\\").replace('"', '\\"')
    lines = []
    gauges = [
        ("hpctk_step", "step", "optimizer steps done"),
        ("hpctk_samples_per_second", "samples_per_s", "training throughput, all ranks"),
        ("hpctk_loss", "loss", "training loss, mean over ranks"),
        ("hpctk_accuracy", "accuracy", "training accuracy, mean over ranks"),
    ]
    for name, key, help_text in gauges:
        if key in record:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f'{name}{{run="{label}"}} {float(record[key]):.6g}']
    metrics = {name: value for name, value in task_metrics(record).items() if name != "accuracy"}
    if metrics:
        lines += ["# HELP hpctk_metric a task's training metric, mean over ranks", "# TYPE hpctk_metric gauge"]
        lines += [f'hpctk_metric{{run="{label}",name="{name}"}} {value:.6g}' for name, value in sorted(metrics.items())]
    lines += ["# HELP hpctk_step_phase_seconds step time by phase, mean over ranks", "# TYPE hpctk_step_phase_seconds gauge"]
    lines += [f'hpctk_step_phase_seconds{{run="{label}",phase="{phase}"}} {record.get(f"{phase}_ms", 0.0) / 1000:.6g}' for phase in PHASES]
    return "\n".join(lines) + "\n"


class StepReporter:
    """Rank 0 reports; on other ranks (`steps_file=None`) every method does nothing."""

    def __init__(
        self,
        steps_file: Path | None,
        total_steps: int | None = None,
        log_every: int = 10,
        prometheus_file: Path | None = None,
        tensorboard_dir: Path | None = None,
        run_name: str = "",
        terminal: TextIO | None = None,
    ) -> None:
        self._writer = MetricsWriter(steps_file)
        self.enabled = steps_file is not None
        self.total_steps = total_steps
        self._log_every = max(1, log_every)
        self._prometheus = prometheus_file if self.enabled else None
        self._run_name = run_name
        self._bar = terminal if self.enabled else None  # the caller knows whether a person watches
        self._tensorboard: Any = None
        if self.enabled and tensorboard_dir is not None:
            from torch.utils.tensorboard import (
                SummaryWriter,  # needs the tensorboard package (checked before submission)
            )

            self._tensorboard = SummaryWriter(str(tensorboard_dir))

    def report(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._writer.write(record)
        step = int(record["step"])
        if self._tensorboard is not None:
            for key in ("loss", *task_metrics(record), "samples_per_s", "lr", "grad_norm", *(f"{p}_ms" for p in PHASES)):
                if key in record:
                    self._tensorboard.add_scalar(f"train/{key}", record[key], step)
        if self._bar is not None:
            self._bar.write("\r\033[K" + self._progress_text(record))
            self._bar.flush()
        if step % self._log_every == 0 or step == self.total_steps:
            progress_log.info("%s", self._progress_text(record))
            if self._prometheus is not None:
                tmp = self._prometheus.with_name(self._prometheus.name + ".tmp")
                tmp.write_text(render_prometheus(record, self._run_name))
                tmp.replace(self._prometheus)  # the collector never reads half a file

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

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Per-epoch figures (test accuracy) for TensorBoard too."""
        if self._tensorboard is not None:
            self._tensorboard.add_scalar(tag, value, step)

    def close(self) -> None:
        self._writer.close()
        if self._bar is not None:
            self._bar.write("\n")
            self._bar.flush()
        if self._tensorboard is not None:
            self._tensorboard.close()
