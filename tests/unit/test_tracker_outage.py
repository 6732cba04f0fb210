"""A real MLflow tracking server (`mlflow server`, SQLite) behind a proxy that is cut: down when
a start opens it, back midway, down again at a stop, back for the next start. Training never
stops for it; each outage is one warning line; once it answers it is given what it missed from
steps.jsonl and metrics.jsonl; a start that ends while it is down says so (result.json's
`trackers`), and the next start completes it: every step once, in order, the figures and the
job's parameters too."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.support.runs import ROOT
from tests.support.tcp_fault import CuttableProxy
from trainers.reporting.reporter import StepReporter
from trainers.reporting.trackers import Guarded, TrackedRun, opened

CONFIG = {"optim": {"lr": 0.1}, "trainer": {"epochs": 2}}
# The MLflow tests on one worker, sharing one server (it takes 15 s to start on the test machine)
pytestmark = pytest.mark.xdist_group("mlflow-server")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    where = tmp_path_factory.mktemp("mlflow")
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{where}/db.sqlite", "--default-artifact-root", str(where / "art")]
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.2)
    yield port
    os.killpg(server.pid, signal.SIGKILL)  # a throwaway store: no shutdown to wait for (SIGTERM's took 14 s, SIGINT's 8 s)
    server.wait()


def report(reporter: StepReporter, steps: range) -> None:
    for step in steps:
        reporter.report({"step": step, "loss": 1.0 / step, "samples_per_s": 100.0, "compute_ms": 2.0})
        if step % 4 == 0:
            reporter.moment({"epoch": 1, "step": step, "val_accuracy": step / 100, "world_size": 1})


def test_mlflow_down_at_the_start_midway_and_at_a_stop_ends_with_every_step_once(tmp_path, mlflow_server, monkeypatch, caplog):
    proxy = CuttableProxy(("127.0.0.1", mlflow_server))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"outage-{tmp_path.name}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # each request fails at once while cut
    caplog.set_level(logging.INFO, "trainers.reporting.trackers")
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def start() -> StepReporter:  # tried again at every step while down (retry_s=0)
        return StepReporter(run_dir / "steps.jsonl", sinks=opened(["mlflow"], TrackedRun.of(run_dir, run_dir / "steps.jsonl"), retry_s=0))

    proxy.sever()  # down as the start opens it
    first = start()
    first.config(CONFIG)
    report(first, range(1, 6))
    (guarded,) = [sink for sink in first.sinks if isinstance(sink, Guarded)]
    assert guarded.sink is None and guarded.down is not None
    proxy.mend()
    report(first, range(6, 11))  # back at step 6: given 1-5 and the config, live from then on
    assert guarded.down is None
    proxy.sever()  # down again midway, and still at the stop
    report(first, range(11, 16))
    first.close("STOPPED")
    assert first.trackers["mlflow"].startswith("incomplete: unreachable (") and "the next start gives them to it" in first.trackers["mlflow"]
    told = [r.message for r in caplog.records if r.levelno >= logging.WARNING]
    back = "tracker mlflow is back: it was given what it missed"
    assert [line.split(" (")[0] for line in told] == ["tracker mlflow unreachable", back, "tracker mlflow unreachable"], told

    proxy.mend()
    second = start()  # given steps 11-15 as it opens
    report(second, range(16, 19))
    second.close("FINISHED")
    assert second.trackers == {"mlflow": "complete"}

    from mlflow import MlflowClient

    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name(f"outage-{tmp_path.name}").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["optim.lr"] == "0.1"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, 19))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/accuracy")] == [4, 8, 12, 16]
    proxy.close()


def test_mlflow_down_at_the_end_of_a_finished_start_is_tried_once_more(tmp_path, mlflow_server, monkeypatch):
    proxy = CuttableProxy(("127.0.0.1", mlflow_server))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"end-{tmp_path.name}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    reporter = StepReporter(run_dir / "steps.jsonl", sinks=opened(["mlflow"], TrackedRun.of(run_dir, run_dir / "steps.jsonl"), retry_s=3600))
    report(reporter, range(1, 4))
    proxy.sever()
    report(reporter, range(4, 9))  # down at step 4, not tried again within the hour
    proxy.mend()
    reporter.close("FINISHED")  # the last try: given 4-8, then closed
    assert reporter.trackers == {"mlflow": "complete"}
    from mlflow import MlflowClient

    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name(f"end-{tmp_path.name}").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, 9))
    proxy.close()


START = """
import sys
from pathlib import Path
from trainers.reporting.reporter import StepReporter
from trainers.reporting.trackers import TrackedRun, opened
run_dir, first, last, ended_as = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
reporter = StepReporter(run_dir / "steps.jsonl", sinks=opened(["wandb"], TrackedRun.of(run_dir, run_dir / "steps.jsonl")))
for step in range(first, last + 1):
    reporter.report({"step": step, "loss": 1.0 / step, "samples_per_s": 100.0, "compute_ms": 2.0})
reporter.close(ended_as)
print(reporter.trackers["wandb"])
"""


def start_of(run_dir, first: int, last: int, ended_as: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A start with W&B as rank 0 reports it, in a process of its own (W&B keeps its settings per process)."""
    command = [sys.executable, "-c", START, str(run_dir), str(first), str(last), ended_as]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_wandb_unreachable_at_the_start_is_one_line_and_the_next_start_gives_it_every_step(tmp_path):
    """W&B online with its server unreachable: wandb.init gives up after WANDB_INIT_TIMEOUT, the
    start trains on without it (one warning line), result.json's state says so; the next start
    (offline here: no W&B server in the tests) gives that run id every step it missed."""
    from tests.support.wandb_files import history

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    env.pop("WANDB_SERVICE", None)  # an earlier test's W&B in this process: a child would use its (offline) service
    unreachable = {"WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "a" * 40, "WANDB_INIT_TIMEOUT": "5"}
    down = start_of(run_dir, 1, 4, "STOPPED", {**env, **unreachable})
    assert down.returncode == 0, down.stderr[-2000:]
    assert down.stdout.startswith("incomplete: unreachable (CommError: ") and "the next start gives them to it" in down.stdout
    (line,) = [line for line in down.stderr.splitlines() if "tracker wandb" in line]
    assert "tracker wandb unreachable (opening it failed: CommError: " in line and "training goes on; the next start gives it what it missed" in line
    assert "Traceback" not in down.stderr
    back = start_of(run_dir, 5, 7, "FINISHED", {**env, "WANDB_MODE": "offline"})
    assert back.returncode == 0 and back.stdout.strip() == "complete", back.stderr[-2000:]
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    assert [row["_step"] for row in history(tmp_path / "wandb", run_id) if "train/loss" in row] == list(range(1, 8))
