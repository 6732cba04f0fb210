"""A real MLflow tracking server (`mlflow server`, SQLite) behind a proxy that is cut: down when
a start opens it, back midway, down again at a stop, back for the next start. Training never
stops for it; each outage is one warning line; once it answers it is given what it missed from
steps.jsonl and figures.jsonl; a start that ends while it is down says so (result.json's
`trackers`), and the next start completes it: every step once, in order, the figures and the
job's parameters too."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.support.tcp_fault import CuttableProxy
from trainers.reporting.reporter import StepReporter
from trainers.reporting.trackers import Guarded, TrackedRun, opened

CONFIG = {"optim": {"lr": 0.1}, "trainer": {"epochs": 2}}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    where = tmp_path_factory.mktemp("mlflow")
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{where}/db.sqlite", "--default-artifact-root", str(where / "art")]
    server = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.2)
    yield port
    server.terminate()
    server.wait(timeout=30)


def report(reporter: StepReporter, steps: range) -> None:
    for step in steps:
        reporter.report({"step": step, "loss": 1.0 / step, "samples_per_s": 100.0, "compute_ms": 2.0})
        if step % 4 == 0:
            reporter.figures({"val/accuracy": step / 100}, step)


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
