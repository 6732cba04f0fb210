"""Experiment trackers as metrics sinks (trainers/reporting/sinks.py): MLflow and Weights & Biases, one
tracker run per toolkit run from its first start to its last requeue.

The tracker's run id is kept in the run dir (trackers.json) at the first start; every later
start reopens that run. A start after a crash trains again the steps between the last committed
checkpoint and the crash: those were logged already, so a tracker is given only the steps after
the last one it holds (MLflow says which; for W&B, the last step a clean finish confirmed or,
offline, the earlier starts' transaction logs hold). Each tracker reads its own standard
variables (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, WANDB_PROJECT, WANDB_MODE, ...): nothing
of them is written into the run dir, and the library is imported only when the job chose it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.reporting.sinks import MOMENTS_FILE, MetricsSink, PrometheusFile, TensorBoardSink, moment_scalars, scalars
from trainers.reporting.wandb_logs import ended, last_step_of, last_step_written, logs_of, readable

TRACKERS_FILE = "trackers.json"  # in the run dir: {"mlflow": {"run_id": ...}, "wandb": {"id": ...}}
TAIL_BYTES = 1 << 16  # enough of steps.jsonl's end to hold its last record
log = logging.getLogger("trainers.reporting.trackers")


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker is told of the toolkit's run."""

    run_dir: Path
    name: str  # the run's name in the tracker (the run dir's; a sweep point's: sweep/point)
    group: str | None  # the sweep a point belongs to (W&B's group, MLflow's hpctk.sweep tag)
    logged_through: int | None  # the last step reported before this start (None: none)
    steps_file: Path  # steps.jsonl: every step reported, in the order reported

    @classmethod
    def of(cls, run_dir: Path, steps_file: Path) -> TrackedRun:
        in_sweep = (run_dir.parent / "sweep.json").is_file()
        group = run_dir.parent.name if in_sweep else None
        name = f"{group}/{run_dir.name}" if group else run_dir.name
        return cls(run_dir, name, group, last_step(steps_file), steps_file)

    def remembered(self, tracker: str) -> dict[str, Any] | None:
        path = self.run_dir / TRACKERS_FILE
        if not path.is_file():
            return None
        entry = json.loads(path.read_text()).get(tracker)
        return entry if isinstance(entry, dict) else None

    def remember(self, tracker: str, entry: dict[str, Any]) -> None:
        """Written whole (a temporary file renamed): a start killed here leaves the old file or the new."""
        path = self.run_dir / TRACKERS_FILE
        known = json.loads(path.read_text()) if path.is_file() else {}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**known, tracker: entry}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)


def last_step(steps_file: Path) -> int | None:
    """The step of steps.jsonl's last complete record (None: no file, or no record)."""
    try:
        with steps_file.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            tail = f.read()
    except FileNotFoundError:
        return None
    for line in reversed(tail.split(b"\n")):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a kill, or the first one cut by the seek
    return None


def numbered(path: Path, after: int | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(step, record) of a JSON-lines file's records with a step after `after` (all: None), in
    file order; a line cut by a kill, or without a step, is passed over; no file: none."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        try:
            record = json.loads(line)
            number = int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if after is None or number > after:
            yield number, record


def records_after(steps_file: Path, step: int | None) -> list[dict[str, Any]]:
    """steps.jsonl's records of the steps after `step` (all: None), each step's first record
    (a step trained again after a crash was reported again), in step order."""
    first: dict[int, dict[str, Any]] = {}
    for number, record in numbered(steps_file, step):
        first.setdefault(number, record)
    return [first[number] for number in sorted(first)]


def moments_after(moments_file: Path, step: int | None) -> dict[int, dict[str, float]]:
    """What metrics.jsonl's moments after `step` plot (moment_scalars), merged by step (the first
    value of each)."""
    merged: dict[int, dict[str, float]] = {}
    for number, record in numbered(moments_file, step):
        merged[number] = {**moment_scalars(record), **merged.get(number, {})}
    return {number: plotted for number, plotted in merged.items() if plotted}


def latest(*steps: int | None) -> int | None:
    """The highest of the steps given (None: none given)."""
    known = [step for step in steps if step is not None]
    return max(known) if known else None


def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys (`optim.lr`), each value as text."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat(value, name + "."))
        else:
            out[name] = json.dumps(value) if not isinstance(value, str) else value
    return out


class Tracker:
    """What both trackers share: steps already held by the tracker are not given again, and a
    moment is given what it plots (moment_scalars), through the tracker's own `log`."""

    holds_through: int | None = None

    def fresh(self, step: int) -> bool:
        return self.holds_through is None or step > self.holds_through

    def log(self, figures: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def moment(self, record: Mapping[str, Any]) -> None:
        step, plotted = int(record["step"]), moment_scalars(record)
        if plotted and self.fresh(step):
            self.log(plotted, step)


class MlflowTracker(Tracker):
    """An MLflow run through MlflowClient (the tracking URI from MLFLOW_TRACKING_URI, else MLflow's
    default); the experiment from MLFLOW_EXPERIMENT_ID or MLFLOW_EXPERIMENT_NAME (made if new),
    else MLflow's default experiment."""

    PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch call
    METRICS_PER_BATCH = 1000  # and its limit of metrics
    PARAM_CHARS = 6000  # MLflow's longest parameter value

    def __init__(self, run: TrackedRun) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient()
        known = run.remembered("mlflow")
        self.reopened = known is not None
        if known is not None:
            self.run_id = str(known["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {"hpctk.run_dir": str(run.run_dir), **({"hpctk.sweep": run.group} if run.group else {})}
            created = self.client.create_run(self.experiment_id(), run_name=run.name, tags=tags)
            self.run_id = created.info.run_id
            run.remember("mlflow", {"run_id": self.run_id})
        self.holds_through = self.catch_up(run)

    def experiment_id(self) -> str:
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return "0"  # MLflow's "Default" experiment
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def last_logged_step(self) -> int | None:
        """The highest step of any metric of the run: MLflow keeps each metric's value of the
        highest step as its latest (RunData's metric objects carry that step)."""
        data = self.client.get_run(self.run_id).data
        steps = [metric.step for metric in getattr(data, "_metric_objs", [])]
        return max(steps) if steps else None

    def log(self, figures: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in figures.items()])

    def catch_up(self, run: TrackedRun) -> int | None:
        """What steps.jsonl and metrics.jsonl hold after the run's last step in MLflow, given (a
        tracker that was down, here or at an earlier start); the last step MLflow then holds."""
        from mlflow.entities import Metric

        held = self.last_logged_step()
        figures = moments_after(run.steps_file.with_name(MOMENTS_FILE), held)
        now = int(time.time() * 1000)
        batch: list[Any] = []
        for record in records_after(run.steps_file, held):
            step = int(record["step"])
            batch += [Metric(key, value, now, step) for key, value in {**scalars(record), **figures.pop(step, {})}.items()]
        for step, figured in figures.items():  # moments of a step with no record (a script's log() at its own step)
            batch += [Metric(key, value, now, step) for key, value in figured.items()]
        for first in range(0, len(batch), self.METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[first : first + self.METRICS_PER_BATCH])
        return latest(held, *(metric.step for metric in batch))

    def step(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        if self.fresh(step):
            self.log(scalars(record), step)

    def config(self, config: Mapping[str, Any]) -> None:
        if self.reopened:
            return  # logged at the first start (MLflow refuses a parameter logged again)
        from mlflow.entities import Param

        params = [Param(key, value[: self.PARAM_CHARS]) for key, value in flat(config).items()]
        for first in range(0, len(params), self.PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[first : first + self.PARAMS_PER_BATCH])

    def close(self, status: str) -> None:
        if status == "STOPPED":  # stopped to resume: the requeued job reopens it
            self.client.update_run(self.run_id, status="SCHEDULED")
        else:
            self.client.set_terminated(self.run_id, status="FINISHED" if status == "FINISHED" else "FAILED")


class WandbTracker(Tracker):
    """A Weights & Biases run (wandb.init with the kept id and resume="allow"; project, entity,
    mode and directory from WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, WANDB_DIR).

    W&B's records go through its wandb-core process, which buffers them: killed with the job
    (SIGKILL, or the SIGTERM Slurm sends every process of a requeued job), it loses what it held.
    So the toolkit counts as held only what a clean finish confirmed (`through` in trackers.json),
    and a start after any other end first gives W&B, from steps.jsonl, the steps after that
    (their first values; W&B ignores a step below the one it holds online)."""

    def __init__(self, run: TrackedRun) -> None:
        import wandb

        known = run.remembered("wandb")
        self.tracked = run
        self.run_id = str(known["id"]) if known is not None else secrets.token_hex(6)  # W&B takes [a-z0-9] ids
        if known is None:
            run.remember("wandb", {"id": self.run_id})  # before init: a start killed in it reopens the same id
        self.run = wandb.init(id=self.run_id, resume="allow", name=run.name, group=run.group)
        confirmed = latest(known.get("through") if known is not None else None, self.written_offline())
        self.confirmed_at_start = confirmed
        self.last_logged: int | None = confirmed
        if run.logged_through is not None and (confirmed is None or confirmed < run.logged_through):
            self.replay(run, confirmed)
        self.holds_through = latest(run.logged_through, confirmed)

    def written_offline(self) -> int | None:
        """Offline, the last step the earlier starts' logs hold: a start killed before finish()
        returned (SIGTERM reaches wandb-core too) may have written steps after the confirmed
        ones. Online, W&B's server drops a step below the one it holds."""
        if not self.run.offline:
            return None
        current = Path(self.run.settings.sync_file)
        earlier = [log for log in logs_of(current.parent.parent, self.run_id) if log != current]
        return last_step_written(earlier)

    def replay(self, run: TrackedRun, confirmed: int | None) -> None:
        """The steps and moments after `confirmed`, as steps.jsonl and metrics.jsonl hold them."""
        figures = moments_after(run.steps_file.with_name(MOMENTS_FILE), confirmed)
        for record in records_after(run.steps_file, confirmed):
            step = int(record["step"])
            self.run.log({**scalars(record), **figures.pop(step, {})}, step=step)
            self.last_logged = step
        for step in sorted(figures):  # moments of a step with no record (a script's log() at its own step)
            if run.logged_through is not None and step <= run.logged_through:
                self.run.log(figures[step], step=step)

    def log_step(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        self.run.log(scalars(record), step=step)
        self.last_logged = step

    def step(self, record: Mapping[str, Any]) -> None:
        if self.fresh(int(record["step"])):
            self.log_step(record)

    def log(self, figures: Mapping[str, float], step: int) -> None:
        self.run.log(dict(figures), step=step)

    def config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def close(self, status: str) -> None:
        if status == "STOPPED":
            self.run.mark_preempting()  # W&B's state for a run that resumes later
        offline, log = self.run.offline, Path(self.run.settings.sync_file)
        self.run.finish(exit_code=1 if status == "FAILED" else 0)
        self.tracked.remember("wandb", {"id": self.run_id, "through": written_through(log, self.confirmed_at_start) if offline else self.last_logged})


FLUSH_WAIT_S = 10.0  # for wandb-core's last records after finish() returned


def written_through(log: Path, confirmed: int | None, wait_s: float = FLUSH_WAIT_S) -> int | None:
    """Offline, the last step a start's log holds once wandb-core wrote its exit record (at
    most `wait_s` later), or `confirmed` before the start: finish() can return before the last
    records are written (measured: 2 of 12 steps missing in 1 of 5 fresh runs), and the job's
    end kills wandb-core with the ranks. Online, the server holds what finish() confirmed."""
    deadline = time.monotonic() + wait_s
    while not ended(held := readable(log)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return latest(confirmed, last_step_of(held))  # the records the exit was seen in: the log read once a poll


TRACKERS: dict[str, Callable[[TrackedRun], MetricsSink]] = {"mlflow": MlflowTracker, "wandb": WandbTracker}
TRACKERS_CATCHING_UP = {"mlflow": True}  # opened again within a start after an outage
# Every name `trackers=[...]` takes, and the package it needs (checked on the login node).
PACKAGES = {"mlflow": "mlflow", "prometheus": "prometheus_client", "tensorboard": "tensorboard", "wandb": "wandb"}
DEFAULT_PROMETHEUS_FILE = "metrics.prom"  # in the run dir, where trainer.prometheus_file names none


# MLflow's own retries take minutes against a server that is down (7 tries, backoff 2 s doubling,
# 120 s timeout), all on rank 0's step: a rank cuts them to seconds where the user set none
# (Guarded tries again later, and the catch-up gives the server what it missed).
SHORT_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
RETRY_S = 60.0  # between tries of a tracker that is down (HPCTK_TRACKER_RETRY_S overrides)


def opened(names: list[str], run: TrackedRun, retry_s: float | None = None) -> list[MetricsSink]:
    """The trackers among `names`, each behind Guarded: a tracker that cannot be opened (its
    server down, a bad URI) or fails midway is told in one warning line and training goes on."""
    wait = float(os.environ.get("HPCTK_TRACKER_RETRY_S", RETRY_S)) if retry_s is None else retry_s
    return [Guarded(name, functools.partial(TRACKERS[name], run), wait) for name in names if name in TRACKERS]


class Guarded:
    """A tracker that may be down: its failure (at the start, or a request that failed after the
    library's own retries) is one warning line, and training and the run's own files go on.

    A tracker that can catch up (`catches_up`: MLflow, whose server says what it holds) is tried
    again on rank 0's reporting path every `retry_s` and at the end of the start, each try a
    fresh open that gives it, from steps.jsonl and metrics.jsonl, what it missed. No thread: a
    try costs the step it happens at a few seconds at most (the library's retries are cut short),
    and nothing is left running when the start ends. W&B is never opened twice in a start (a
    second run in wandb-core's process is not safe); its next start gives it what it missed.
    `state` says how this start left it, for result.json."""

    def __init__(self, name: str, open_sink: Callable[[], MetricsSink], retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.open_sink, self.retry_s, self.clock = name, open_sink, retry_s, clock
        self.sink: MetricsSink | None = None
        self.down: str | None = None  # why, while it is down
        self.next_try = 0.0
        self.config_given: Mapping[str, Any] | None = None
        self.retries = TRACKERS_CATCHING_UP.get(name, False)
        self.reopen("opening it")

    def reopen(self, what: str) -> None:
        try:
            sink = self.open_sink()
            if self.config_given is not None:
                sink.config(self.config_given)
        except Exception as err:  # noqa: BLE001 - any library's failure
            self.went_down(what, err)
            return
        if self.down is not None:
            log.warning("tracker %s is back: it was given what it missed", self.name)
        self.sink, self.down = sink, None

    def went_down(self, what: str, err: Exception) -> None:
        why = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        if self.down is None:
            again = f"tried again every {self.retry_s:.0f} s" if self.retries else "the next start gives it what it missed"
            log.warning("tracker %s unreachable (%s failed: %s): training goes on; %s", self.name, what, why, again)
        self.sink, self.down, self.next_try = None, why, self.clock() + self.retry_s

    def call(self, method: str, *args: Any) -> None:
        if self.sink is None and self.retries and self.clock() >= self.next_try:
            self.reopen("trying it again")
        if self.sink is None:
            return
        try:
            getattr(self.sink, method)(*args)
        except Exception as err:  # noqa: BLE001 - any library's failure
            self.went_down(method, err)

    @property
    def state(self) -> str:
        """`complete`, or why not and what completes it, for result.json's `trackers`."""
        if self.down is None:
            return "complete"
        return f"incomplete: unreachable ({self.down}); steps.jsonl keeps its records, the next start gives them to it"

    def step(self, record: Mapping[str, Any]) -> None:
        self.call("step", record)

    def moment(self, record: Mapping[str, Any]) -> None:
        self.call("moment", record)

    def config(self, config: Mapping[str, Any]) -> None:
        self.config_given = config
        self.call("config", config)

    def close(self, status: str) -> None:
        """The end of this start. A tracker still down is tried once more, except on a stop (its
        grace time is for the checkpoint; the next start gives the tracker what it missed)."""
        if self.sink is None and self.retries and status != "STOPPED":
            self.reopen("trying it at the end")
        if self.sink is not None:
            self.call("close", status)


def chosen(trackers: list[str], tensorboard: bool, prometheus_file: str | None) -> list[str]:
    """The sinks a job asked for beyond steps.jsonl and the terminal: `trackers`, with
    trainer.tensorboard=true and trainer.prometheus_file as the older spellings of two of them."""
    names = list(dict.fromkeys(trackers))
    if tensorboard and "tensorboard" not in names:
        names.append("tensorboard")
    if prometheus_file and "prometheus" not in names:
        names.append("prometheus")
    return names


@dataclass(frozen=True)
class SinkSettings:
    """What the chosen sinks are told of a run at a start."""

    run_dir: Path
    steps_file: Path  # steps.jsonl (metrics.jsonl beside it)
    prometheus_file: str | None  # trainer.prometheus_file; relative: in the run dir
    log_every: int  # trainer.log_every: the Prometheus file is rewritten that often


FILE_SINKS: dict[str, Callable[[SinkSettings], MetricsSink]] = {
    "prometheus": lambda at: PrometheusFile(at.run_dir / (at.prometheus_file or DEFAULT_PROMETHEUS_FILE), at.run_dir.name, every=at.log_every),
    "tensorboard": lambda at: TensorBoardSink(at.run_dir / "tensorboard"),
}


def opened_sinks(names: list[str], at: SinkSettings) -> list[MetricsSink]:
    """The sinks `names` chose (as `chosen` gives them), opened for this start: the file sinks,
    then the trackers behind Guarded, told what steps.jsonl held before this start appends to it."""
    files = [FILE_SINKS[name](at) for name in FILE_SINKS if name in names]
    return files + (opened(names, TrackedRun.of(at.run_dir, at.steps_file)) if any(name in TRACKERS for name in names) else [])
