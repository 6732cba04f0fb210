"""Per-step reporting: the straggler rule, the Prometheus text, the files rank 0 writes."""

from __future__ import annotations

import json

import pytest

from trainers.reporting.reporter import StepReporter, find_straggler
from trainers.reporting.sinks import PrometheusFile, TensorBoardSink, moment_scalars
from trainers.reporting.trackers import SinkSettings, chosen, opened_sinks


def test_straggler_is_the_slowest_rank_above_the_ratio_of_the_median():
    found = find_straggler([10.0, 11.0, 30.0, 10.5], ["n1", "n1", "n2", "n2"], ratio=1.5)
    assert (found.rank, found.host, found.median_ms) == (2, "n2", 10.75)
    assert found.ratio == pytest.approx(30 / 10.75)
    assert "rank 2 on n2" in found.line()
    assert find_straggler([10.0, 11.0, 14.0], ["a", "b", "c"], ratio=1.5) is None
    assert find_straggler([10.0], ["a"], ratio=1.5) is None


def prometheus_samples(path):
    """The file as Prometheus's own parser reads it: {(name, labels...): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, *sorted(sample.labels.items())): sample.value for family in text_string_to_metric_families(path.read_text()) for sample in family.samples
    }


def test_prometheus_file_has_gauges_task_metrics_and_phases(tmp_path):
    prom = tmp_path / "metrics.prom"
    reporter = StepReporter(tmp_path / "steps.jsonl", log_every=1, sinks=[PrometheusFile(prom, 'run "x"', every=1)])
    reporter.report({"step": 7, "samples_per_s": 123.5, "loss": 0.25, "perplexity": 3.5, "data_ms": 2.0, "compute_ms": 10.0})
    run = ("run", 'run "x"')
    samples = prometheus_samples(prom)
    assert samples[("hpctk_step", run)] == 7
    assert samples[("hpctk_samples_per_second", run)] == 123.5
    assert samples[("hpctk_loss", run)] == 0.25
    assert samples[("hpctk_metric", ("name", "perplexity"), run)] == 3.5
    assert samples[("hpctk_step_phase_seconds", ("phase", "data"), run)] == 0.002
    assert samples[("hpctk_step_phase_seconds", ("phase", "optimizer"), run)] == 0.0
    assert ("hpctk_accuracy", run) not in samples  # never reported: no made-up value
    assert "# TYPE hpctk_loss gauge" in prom.read_text()


def test_rank0_writes_every_step_and_prometheus_every_log_interval_and_at_the_end(tmp_path):
    prom = tmp_path / "metrics.prom"
    reporter = StepReporter(tmp_path / "steps.jsonl", total_steps=5, log_every=2, sinks=[PrometheusFile(prom, "r", every=2)])
    exported = []
    for step in range(1, 6):
        reporter.report({"step": step, "loss": 1.0, "samples_per_s": 10.0 * step})
        exported.append(next(line for line in prom.read_text().splitlines() if line.startswith("hpctk_step{")) if prom.exists() else None)
    reporter.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    # Rewritten at steps 2 and 4 (every log_every), unchanged in between, and at the end.
    assert exported == [None, 'hpctk_step{run="r"} 2.0', 'hpctk_step{run="r"} 2.0', 'hpctk_step{run="r"} 4.0', 'hpctk_step{run="r"} 4.0']
    assert prometheus_samples(prom)[("hpctk_step", ("run", "r"))] == 5


def test_a_run_closed_before_its_first_step_exports_nothing(tmp_path):
    reporter = StepReporter(tmp_path / "steps.jsonl", sinks=[PrometheusFile(tmp_path / "metrics.prom", "r")])
    reporter.close("STOPPED")
    assert not (tmp_path / "metrics.prom").exists()  # no figure was ever measured


def test_other_ranks_write_nothing(tmp_path):
    reporter = StepReporter(None, sinks=[PrometheusFile(tmp_path / "p.prom", "r")])
    reporter.report({"step": 10, "loss": 1.0})
    reporter.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_event_files_hold_the_step_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reporter = StepReporter(tmp_path / "steps.jsonl", sinks=[TensorBoardSink(tmp_path / "tb")])
    for step in (1, 2):
        reporter.report({"step": step, "loss": 1.0 / step, "samples_per_s": 5.0})
    reporter.moment({"step": 2, "test_accuracy": 0.75, "world_size": 2})
    reporter.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5)]
    assert events.Scalars("test/accuracy")[0].value == 0.75
    assert "world_size" not in events.Tags()["scalars"]  # where a moment is, not what it measured


def test_every_record_kind_has_one_file_and_one_writer_and_each_plotting_sink_names_figures_alike(tmp_path):
    """The chosen sinks come from their names alone (the older trainer flags translated by
    `chosen`); the run dir's files come with every reporter: steps.jsonl gets the steps,
    metrics.jsonl the moments, each whole, and no other file appears beside them."""
    run_dir = tmp_path / "run"
    names = chosen([], tensorboard=True, prometheus_file="own.prom")
    reporter = StepReporter(run_dir / "steps.jsonl", log_every=1, sinks=opened_sinks(names, SinkSettings(run_dir, run_dir / "steps.jsonl", "own.prom", 1)))
    reporter.report({"step": 1, "loss": 0.5, "samples_per_s": 4.0})
    reporter.moment({"epoch": 1, "step": 1, "loss": 0.5, "val_loss": 0.75, "peak_memory_mib": [1.0, 2.0], "world_size": 2})
    reporter.close()
    assert sorted(path.name for path in run_dir.iterdir()) == ["metrics.jsonl", "own.prom", "steps.jsonl", "tensorboard"]
    (moment,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert moment["val_loss"] == 0.75 and moment["peak_memory_mib"] == [1.0, 2.0] and moment["epoch"] == 1
    assert [json.loads(line)["step"] for line in (run_dir / "steps.jsonl").read_text().splitlines()] == [1]
    assert moment_scalars(moment) == {"loss": 0.5, "val/loss": 0.75}
    reporter.moment({"step": 1, "val_late": 1.5})  # a script's log() after finish(): the file still takes it
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["val_late"] == 1.5
    assert moment_scalars({"step": 3, "test_acc": float("nan"), "lr": 0.1, "done": True}) == {"lr": 0.1}


def test_a_terminal_gets_tqdms_bar_redrawn_in_place_with_log_lines_above_it(tmp_path):
    import io
    import logging

    from hpc.rank.main import AboveTheBar

    terminal = io.StringIO()
    console = AboveTheBar(terminal)
    said = logging.getLogger("test.above")
    said.addHandler(console)
    said.setLevel(logging.INFO)
    reporter = StepReporter(tmp_path / "steps.jsonl", total_steps=40, terminal=terminal, columns=200)
    reporter.report({"step": 1, "loss": 2.5, "accuracy": 0.25, "samples_per_s": 1000.0, "data_ms": 0.5, "compute_ms": 3.0})
    said.info("epoch 1/2: val_loss 0.5")
    reporter.report({"step": 2, "loss": 2.0, "accuracy": 0.5, "samples_per_s": 1100.0, "compute_ms": 3.0})
    reporter.close()
    said.removeHandler(console)
    shown = terminal.getvalue()
    first, line, rest = shown.partition("epoch 1/2: val_loss 0.5\n")
    assert first.startswith("\rstep 1/40  loss 2.5000  acc 0.250  1000 samples/s  ms: data 0.5 compute 3.0 comm 0.0 optimizer 0.0") and " 2% [" in first
    assert first.endswith("\r") and first.rstrip("\r ").endswith("]")  # the bar lifted (blanked) before the log line
    assert rest.startswith("\rstep 1/40") and "\rstep 2/40  loss 2.0000  acc 0.500" in rest and " 5% [" in rest  # drawn again below it
    assert shown.endswith("\n") and shown.count("\n") == 2  # the log line's, and the bar's last line kept


def test_the_progress_line_shows_the_steps_lr_and_gradient_norm_where_logged():
    """Warm-up and clipping can be seen (issue 45): the lr a step used, and the norm before clipping."""
    reporter = StepReporter(None)
    line = reporter._progress_text({"step": 3, "loss": 2.0, "samples_per_s": 10.0, "compute_ms": 1.0, "lr": 0.000125, "grad_norm": 3.14159})
    assert "  lr 0.000125  grad-norm 3.14  10 samples/s" in line
    assert "lr" not in reporter._progress_text({"step": 3, "loss": 2.0, "samples_per_s": 10.0, "compute_ms": 1.0}).split()


def test_a_small_loss_is_never_shown_as_zero():
    """Late in training a loss of 1.6e-05 printed as 0.0000 (issue 45); ordinary figures keep four places."""
    from trainers.reporting.reporter import four_places

    assert [four_places(v) for v in (1.6e-05, -2.5e-4, 0.0, 0.5, 0.0012345, 12.3)] == ["1.6e-05", "-0.00025", "0.0000", "0.5000", "0.0012", "12.3000"]
    reporter = StepReporter(None)
    line = reporter._progress_text({"step": 3, "loss": 1.6e-05, "step_ms": 2.0})  # a script's step
    assert "loss 1.6e-05" in line
