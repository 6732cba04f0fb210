"""Experiment trackers as metrics sinks (trainers/reporting/trackers.py), against the real libraries: an
MLflow tracking store (SQLite) and W&B in offline mode, its files read back. A toolkit run is one
tracker run over all its starts, and a step the tracker holds is never logged again."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from hpc.config.schema import JobConfig
from hpc.config.validate import check_trackers
from hpc.errors import UserError
from tests.support.wandb_files import history, records, run_records
from trainers.reporting.reporter import StepReporter
from trainers.reporting.trackers import TRACKERS_FILE, TrackedRun, last_step, opened, records_after, written_through
from trainers.reporting.wandb_logs import last_step_written

# A config as the ranks read it: nested, with a value longer than MLflow takes and more keys
# than one of its requests carries.
CONFIG = {"optim": {"lr": 0.1, "name": "sgd"}, "trainer": {"epochs": 2}, "task": {"prompt": "p" * 7000, **{f"k{i}": i for i in range(150)}}}


def start(run_dir: Path, names: list[str], steps: range, loss_offset: float, ended_as: str, during=None) -> None:
    """One start of a run: its reporter as a rank 0 builds it, steps reported, `during()`, then closed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tracked = TrackedRun.of(run_dir, run_dir / "steps.jsonl")
    reporter = StepReporter(run_dir / "steps.jsonl", sinks=opened(names, tracked))
    reporter.config(CONFIG)
    for step in steps:
        reporter.report({"step": step, "loss": loss_offset + 1.0 / step, "samples_per_s": 100.0, "compute_ms": 2.0})
        if step % 4 == 0:
            reporter.moment({"epoch": 1, "step": step, "val_accuracy": step / 10, "world_size": 1})
    if during is not None:
        during()
    reporter.close(ended_as)


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hpctk-tests")
    from mlflow import MlflowClient

    return MlflowClient()


def test_mlflow_one_run_over_a_stop_and_a_crash_no_step_logged_twice(tmp_path, mlflow_store):
    run_dir = tmp_path / "runs" / "sweep" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir.parent / "sweep.json").write_text("{}")  # a sweep point: tagged with its sweep
    began = time.time()
    start(run_dir, ["mlflow"], range(1, 7), 0.0, "STOPPED")  # stopped at step 6 to requeue
    run_id = (run_dir / TRACKERS_FILE).read_text()
    (run,) = mlflow_store.search_runs([mlflow_store.get_experiment_by_name("hpctk-tests").experiment_id])
    assert run.info.status == "SCHEDULED"
    params = run.data.params  # the config at the first start: dotted keys, cut to MLflow's 6000 characters, in batches of 100
    assert params["optim.lr"] == "0.1" and params["optim.name"] == "sgd" and params["task.k149"] == "149" and params["task.prompt"] == "p" * 6000
    (loss,) = [m for m in mlflow_store.get_metric_history(run.info.run_id, "train/loss") if m.step == 1]
    assert began * 1000 - 1 <= loss.timestamp <= time.time() * 1000 + 1  # milliseconds, as MLflow keeps them

    def running() -> None:
        assert mlflow_store.get_run(run.info.run_id).info.status == "RUNNING"  # reopened

    # Resumed from a checkpoint of step 4 after a crash: steps 5 and 6 trained again (other
    # values here, to tell them apart), then on to 10.
    start(run_dir, ["mlflow"], range(5, 11), 100.0, "FINISHED", during=running)
    assert (run_dir / TRACKERS_FILE).read_text() == run_id
    runs = mlflow_store.search_runs([mlflow_store.get_experiment_by_name("hpctk-tests").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_name == "sweep/r1"
    assert runs[0].data.tags["hpctk.sweep"] == "sweep" and runs[0].data.tags["hpctk.run_dir"] == str(run_dir)
    losses = mlflow_store.get_metric_history(runs[0].info.run_id, "train/loss")
    assert [m.step for m in losses] == list(range(1, 11))
    assert [m.value for m in losses][4:6] == [1 / 5, 1 / 6]  # the first start's values were kept
    assert [m.value for m in losses][6] == 100 + 1 / 7
    assert [m.step for m in mlflow_store.get_metric_history(runs[0].info.run_id, "val/accuracy")] == [4, 8]
    assert runs[0].data.params["optim.lr"] == "0.1" and runs[0].data.params["optim.name"] == "sgd"


def start_holding(wandb_dir: Path, run_id: str, step: int) -> Path:
    """The one start's offline dir whose log holds `step`: read right after the start returned,
    since a start's close waits for wandb-core's last records (trackers.written_through)."""
    (path,) = [p for p in wandb_dir.glob(f"offline-run-*-{run_id}*") if step in [row["_step"] for row in history_of(p, run_id)]]
    return path


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch) -> Path:
    """W&B offline; its files under the dir returned. W&B reads WANDB_DIR once per process (at
    its first run), so a later test of the same worker finds it where the first one put it."""
    import wandb

    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    return Path(wandb.setup().settings.wandb_dir)


def test_wandb_offline_one_run_over_a_stop_and_a_crash_no_step_logged_twice(tmp_path, wandb_dir):
    sweep = tmp_path / "sweep"
    run_dir = sweep / "3"
    run_dir.mkdir(parents=True)
    (sweep / "sweep.json").write_text("{}")  # a sweep point: grouped by its sweep
    start(run_dir, ["wandb"], range(1, 5), 0.0, "STOPPED")
    run_id = json.loads((run_dir / TRACKERS_FILE).read_text())["wandb"]["id"]
    assert json.loads((run_dir / TRACKERS_FILE).read_text())["wandb"] == {"id": run_id, "through": 4}
    start(run_dir, ["wandb"], range(5, 9), 0.0, "STOPPED")
    # Then the job was killed with wandb-core holding the second start's records: its files
    # hold nothing, and no clean finish confirmed them.
    second = start_holding(wandb_dir, run_id, 5)
    (second / f"run-{run_id}.wandb").write_bytes(b":W&B\xe1\xbe\x00")
    (run_dir / TRACKERS_FILE).write_text(json.dumps({"wandb": {"id": run_id, "through": 4}}))
    assert last_step(run_dir / "steps.jsonl") == 8
    # Resumed from a checkpoint of step 6: steps 7 and 8 trained again (other values), on to 10.
    start(run_dir, ["wandb"], range(7, 11), 100.0, "FINISHED")
    starts = list(wandb_dir.glob(f"offline-run-*-{run_id}*"))  # a start in the same second as the one before: "-1" added
    assert len(starts) == 3 and all(p.name.split("-")[3] == run_id for p in starts)
    rows = [row for row in history(wandb_dir, run_id) if "train/loss" in row]
    assert [row["_step"] for row in rows] == list(range(1, 11))  # 5-8 from steps.jsonl, given again
    assert [row["train/loss"] for row in rows][6:9] == [1 / 7, 1 / 8, 100 + 1 / 9]  # steps.jsonl's first values kept
    assert json.loads((run_dir / TRACKERS_FILE).read_text())["wandb"]["through"] == 10
    assert [row["_step"] for row in history(wandb_dir, run_id) if "val/accuracy" in row] == [4, 8]
    kinds = [[record.WhichOneof("record_type") for record in records(p / f"run-{run_id}.wandb")] for p in sorted(starts)]
    assert ["preempting" in kind for kind in kinds] == [True, False, False]  # the stops; the crashed start's file was emptied
    exits = [record.exit.exit_code for p in sorted(starts) for record in records(p / f"run-{run_id}.wandb") if record.WhichOneof("record_type") == "exit"]
    assert exits == [0, 0]
    configs = [record.config for p in sorted(starts) for record in records(p / f"run-{run_id}.wandb") if record.WhichOneof("record_type") == "config"]
    assert any(item.key == "optim" and json.loads(item.value_json) == {"lr": 0.1, "name": "sgd"} for config in configs for item in config.update)
    assert {(r.run_id, r.display_name, r.run_group) for r in run_records(wandb_dir, run_id)} == {(run_id, "sweep/3", "sweep")}


def test_wandb_offline_steps_a_killed_start_wrote_are_not_given_again(tmp_path, wandb_dir):
    """wandb-core writes what it is given until it is killed: the next start reads the earlier
    starts' logs (cut mid-record by the kill) and gives W&B only the steps after the last one written."""
    run_dir = tmp_path / "run"
    start(run_dir, ["wandb"], range(1, 5), 0.0, "STOPPED")
    run_id = json.loads((run_dir / TRACKERS_FILE).read_text())["wandb"]["id"]
    start(run_dir, ["wandb"], range(5, 13), 0.0, "STOPPED")
    # Then killed before finish() returned: no clean finish confirmed 5-12, and the log was cut
    # partway through the record of one of them.
    second = start_holding(wandb_dir, run_id, 5)
    log = second / f"run-{run_id}.wandb"
    data = log.read_bytes()
    whole_through_9 = next(size for size in range(len(data)) if last_step_written([write(tmp_path / "cut", data[:size])]) == 9)
    # Wherever the kill cut the next record, what was written whole is read, and no more
    assert {last_step_written([write(tmp_path / "cut", data[: whole_through_9 + more])]) for more in range(1, 120)} == {9}
    log.write_bytes(data[: whole_through_9 + 40])
    (run_dir / TRACKERS_FILE).write_text(json.dumps({"wandb": {"id": run_id, "through": 4}}))
    start(run_dir, ["wandb"], range(11, 15), 100.0, "FINISHED")  # resumed from a checkpoint of step 10
    rows = [row for row in history(wandb_dir, run_id) if "train/loss" in row]
    assert [row["_step"] for row in rows] == list(range(1, 15))  # 10-12 from steps.jsonl, 5-9 not again
    assert [row["train/loss"] for row in rows][9:12] == [1 / 10, 1 / 11, 1 / 12]


def test_a_stop_confirms_only_the_steps_wandb_core_wrote(tmp_path, wandb_dir):
    """finish() can return before wandb-core wrote its last records: the start waits for the
    exit record, and where it never comes confirms only the steps on disk."""
    run_dir = tmp_path / "run"
    start(run_dir, ["wandb"], range(1, 13), 0.0, "STOPPED")
    run_id = json.loads((run_dir / TRACKERS_FILE).read_text())["wandb"]["id"]
    data = (log := start_holding(wandb_dir, run_id, 12) / f"run-{run_id}.wandb").read_bytes()
    through_9 = next(size for size in range(len(data)) if last_step_written([write(tmp_path / "cut", data[:size])]) == 9)
    log.write_bytes(data[:through_9])
    late = threading.Timer(0.3, log.write_bytes, [data])  # wandb-core's last records, after finish()
    late.start()
    assert written_through(log, 4) == 12
    late.join()
    log.write_bytes(data[:through_9])  # killed before it wrote them
    began = time.monotonic()
    assert written_through(log, 4, wait_s=0.3) == 9 and time.monotonic() - began >= 0.3
    assert written_through(write(tmp_path / "empty", data[:7]), 4, wait_s=0) == 4


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def history_of(offline_dir: Path, run_id: str) -> list[dict]:
    """The history rows of one start's offline dir."""
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in records(offline_dir / f"run-{run_id}.wandb")
        if record.WhichOneof("record_type") == "history"
    ]


def test_steps_after_a_mark_are_each_steps_first_record_in_step_order(tmp_path):
    steps = tmp_path / "steps.jsonl"
    assert records_after(steps, None) == []
    steps.write_text("".join(json.dumps({"step": n, "loss": float(n)}) + "\n" for n in (1, 2, 3, 4, 3, 4, 5)) + '{"step": 6, "lo')
    assert [(r["step"], r["loss"]) for r in records_after(steps, 2)] == [(3, 3.0), (4, 4.0), (5, 5.0)]
    assert [r["step"] for r in records_after(steps, None)] == [1, 2, 3, 4, 5]


def test_a_tracker_that_cannot_open_is_one_warning_and_training_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    caplog.set_level(logging.WARNING, "trainers.reporting.trackers")
    start(tmp_path, ["mlflow"], range(1, 3), 0.0, "FINISHED")
    assert last_step(tmp_path / "steps.jsonl") == 2  # steps.jsonl has every step
    assert [r.message.split(" (")[0] for r in caplog.records] == ["tracker mlflow unreachable"]  # not again at each try
    assert not (tmp_path / TRACKERS_FILE).exists()


class Flaky:
    """A tracker whose server is down for the steps in `down` (and at any open then)."""

    opens: list[int] = []

    def __init__(self, down: set[int], at: list[int]) -> None:
        Flaky.opens.append(at[0])  # every try to open it
        if at[0] in down:
            raise ConnectionError("server went away")
        self.down, self.at, self.steps = down, at, []

    def step(self, record):
        if record["step"] in self.down:
            raise ConnectionError("server went away")
        self.steps.append(record["step"])

    def moment(self, record): ...
    def config(self, config): ...
    def close(self, status): ...


@pytest.mark.parametrize(("name", "opens"), [("mlflow", [1, 5]), ("wandb", [1])])
def test_a_tracker_failing_midway_is_tried_again_after_retry_s_if_it_can_catch_up(tmp_path, caplog, name, opens):
    from trainers.reporting.trackers import Guarded

    at, now = [1], [0.0]
    Flaky.opens = []
    caplog.set_level(logging.WARNING, "trainers.reporting.trackers")
    guarded = Guarded(name, lambda: Flaky({2, 3, 4}, at), retry_s=10.0, clock=lambda: now[0])
    reporter = StepReporter(tmp_path / "steps.jsonl", sinks=[guarded])
    for step in range(1, 7):  # down at 2, 3 and 4; a step every 4 s: tried again at 5 (12 s after 2) and not at 3 or 4
        at[0], now[0] = step, 4.0 * (step - 1)
        reporter.report({"step": step, "loss": 1.0})
    reporter.close()
    assert Flaky.opens == opens and last_step(tmp_path / "steps.jsonl") == 6
    told = [r.message for r in caplog.records]
    assert told[0] == f"tracker {name} unreachable (step failed: ConnectionError: server went away): training goes on; " + (
        "tried again every 10 s" if name == "mlflow" else "the next start gives it what it missed"
    )
    left = "incomplete: unreachable (ConnectionError: server went away); steps.jsonl keeps its records, the next start gives them to it"
    assert reporter.trackers == {name: "complete" if name == "mlflow" else left}


def test_the_last_step_survives_a_cut_line_and_a_long_file(tmp_path):
    steps = tmp_path / "steps.jsonl"
    assert last_step(steps) is None
    steps.write_text("".join(f'{{"step": {n}, "loss": 0.5, "pad": "{"x" * 900}"}}\n' for n in range(1, 200)) + '{"step": 200, "lo')
    assert last_step(steps) == 199


@pytest.mark.parametrize(
    ("trackers", "message"),
    [
        (["mlfow"], "trackers: unknown tracker 'mlfow' .known: mlflow, prometheus, tensorboard, wandb."),
        (["prometheus", "comet"], "unknown tracker 'comet'"),
    ],
)
def test_unknown_trackers_are_refused_in_one_line(trackers, message):
    with pytest.raises(UserError, match=message):
        check_trackers(JobConfig(trackers=trackers))


def test_a_tracker_without_its_package_is_refused_naming_the_install(monkeypatch):
    import hpc.config.validate as validate

    monkeypatch.setattr(validate, "installed", lambda module: module != "wandb")
    with pytest.raises(UserError, match=r"trackers: wandb needs the wandb package: pip install wandb"):
        check_trackers(JobConfig(trackers=["mlflow", "wandb"]))
    check_trackers(JobConfig(trackers=["mlflow", "prometheus"]))


def test_a_wandb_start_killed_in_init_reopens_the_same_id(tmp_path, monkeypatch, caplog):
    import wandb

    def killed(**kwargs):
        raise RuntimeError("killed while starting")

    monkeypatch.setattr(wandb, "init", killed)
    caplog.set_level(logging.WARNING, "trainers.reporting.trackers")
    start(tmp_path, ["wandb"], range(1, 2), 0.0, "FAILED")
    assert "tracker wandb unreachable (opening it failed: RuntimeError: killed while starting)" in caplog.text
    kept = json.loads((tmp_path / TRACKERS_FILE).read_text())["wandb"]
    assert set(kept) == {"id"} and kept["id"].isalnum() and kept["id"].islower()  # the next start resumes this id


def test_mlflow_without_an_experiment_named_uses_the_default_or_the_id_given(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    from mlflow import MlflowClient

    client = MlflowClient()
    start(tmp_path / "a", ["mlflow"], range(1, 2), 0.0, "FINISHED")
    assert len(client.search_runs(["0"])) == 1
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", client.create_experiment("by-id"))
    start(tmp_path / "b", ["mlflow"], range(1, 2), 0.0, "FAILED")
    (run,) = client.search_runs([os.environ["MLFLOW_EXPERIMENT_ID"]])
    assert run.info.status == "FAILED" and run.info.run_name == "b"


@pytest.mark.parametrize(
    ("trackers", "tensorboard", "prometheus_file", "expected"),
    [
        ([], False, None, []),
        (["mlflow", "mlflow"], False, None, ["mlflow"]),
        (["wandb"], True, "m.prom", ["wandb", "tensorboard", "prometheus"]),
        (["prometheus", "tensorboard"], True, "m.prom", ["prometheus", "tensorboard"]),
    ],
)
def test_the_older_settings_choose_the_same_sinks(trackers, tensorboard, prometheus_file, expected):
    from trainers.reporting.trackers import chosen

    assert chosen(trackers, tensorboard, prometheus_file) == expected
