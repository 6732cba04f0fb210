"""The cost of an interruption from what a run left behind (hpc.interruptions), and how status and
report show it. End to end on the real Slurm: tests/e2e/test_allocation_restart_slurm.py and
test_preemption.py read the line rank 0 logs."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest

from hpc.interruptions import TIMELINE, Cost, cost_of_interruption, costs, duration, total_line
from hpc.rank.timeline import Timeline
from hpc.rundir import RunDir, read_jsonl
from hpc.tools.report import render_interruptions

STEPS = [{"step": n, "time": 100.0 + n, "step_ms": 1000.0} for n in range(1, 11)]  # one step a second up to step 10 at t=110


def start_event(**fields: object) -> dict[str, object]:
    return {"event": "start", "start": 1, "attempt": 0, "launched": 300.0, "loaded": 306.0, "load_s": 1.0, "first_step": 306.5, "resumed_from": 10, **fields}


def test_a_preemption_then_a_requeue_is_broken_down_with_slurm_s_hold_and_queue_wait_apart():
    stop = {"event": "stop", "signal": "SIGUSR1", "reason": "preemption", "phase": "training", "received": 109.6, "agreed": 110.0, "committed": 110.5}
    failure = {"ended": 111.0}  # the step ended after the commit
    cost = cost_of_interruption(start_event(eligible=231.0, job_started=299.0), "requeue", 50.0, stop, failure, 111.5, STEPS)
    assert cost is not None
    assert cost.cause == "SIGUSR1 (preemption)" and cost.how == "requeue"
    assert cost.to_stop_s == pytest.approx(0.4) and cost.to_commit_s == pytest.approx(0.5) and cost.to_exit_s == pytest.approx(0.5)
    assert (cost.held_s, cost.queued_s) == (pytest.approx(119.5), pytest.approx(68.0))  # requeued 111.5, eligible 231, started 299
    assert cost.relaunch_s == pytest.approx(300.0 - 111.0 - 119.5 - 68.0)
    assert (cost.start_up_s, cost.load_s, cost.first_step_s) == (pytest.approx(5.0), 1.0, pytest.approx(0.5))
    assert cost.total_s == pytest.approx(306.5 - 109.6) and cost.redone_steps == 0
    assert "SIGUSR1 (preemption), requeue: signal->stop 0.4 s" in cost.line() and "0 steps redone" in cost.line()


def test_a_failure_restarted_in_the_allocation_counts_the_steps_trained_since_the_checkpoint():
    failure = {"failed": 110.2, "failure": "node2: task 3: Killed", "ended": 121.0}
    start = start_event(attempt=1, launched=121.1, loaded=125.0, load_s=0.5, first_step=125.4, resumed_from=8)
    cost = cost_of_interruption(start, "restart in the allocation", 50.0, None, failure, None, STEPS)
    assert cost is not None
    assert cost.cause == "failure (node2: task 3: Killed)" and cost.to_stop_s is None and cost.held_s is None
    assert cost.to_exit_s == pytest.approx(10.8) and cost.relaunch_s == pytest.approx(0.1)
    assert cost.redone_steps == 2 and cost.redone_s == pytest.approx(2.0)  # steps 9 and 10 again, at 1 s a step
    assert cost.total_s == pytest.approx(125.4 - 110.2)


def test_without_a_record_the_interruption_begins_at_the_last_step_and_without_steps_it_is_unknown():
    cost = cost_of_interruption(start_event(), "a new launch", None, None, None, None, STEPS)
    assert cost is not None and cost.cause == "failure (cause unknown: no record)" and cost.total_s == pytest.approx(306.5 - 110.0)
    assert cost_of_interruption(start_event(), "requeue", None, None, None, None, []) is None


def test_totals_and_durations():
    cost = cost_of_interruption(start_event(), "a new launch", None, None, None, None, STEPS)
    assert cost is not None
    timeline = [start_event(), {**start_event(), "cost": cost.as_dict()}, {**start_event(), "cost": {**cost.as_dict(), "held_s": 120.0}}]
    assert len(costs(timeline)) == 2
    assert total_line(timeline) == "2 interruptions: 6m33s from cause to resumed step (Slurm's hold 2m00s, queued 0s), 0 steps redone"
    assert total_line([start_event()]) is None
    assert [duration(s) for s in (5, 65, 3700)] == ["5s", "1m05s", "1h01m"]


def test_the_report_has_a_row_per_interruption(tmp_path: Path):
    run = tmp_path / "0"
    run.mkdir()
    cost = Cost("SIGUSR1 (preemption)", "requeue", 0.4, 0.5, 0.5, 1.0, 120.0, 3.0, 5.0, 1.0, 0.5, 131.9, 0, 0.0)
    (run / TIMELINE).write_text(json.dumps(start_event()) + "\n" + json.dumps({**start_event(), "cost": cost.as_dict()}) + "\n")
    table = render_interruptions([RunDir(run)])
    assert table is not None
    header, _, row = table.splitlines()
    assert "held" in header and "queued" in header and "steps redone" in header
    assert row == "| 0 | 1 | SIGUSR1 (preemption) | requeue | 0.4 | 0.5 | 0.5 | 1.0 | 120.0 | 3.0 | 5.0 | 1.0 | 0.5 | 131.9 | 0 |"
    assert render_interruptions([RunDir(tmp_path)]) is None


def test_rank_0_records_a_stop_and_the_cost_of_the_start_after_it(tmp_path: Path):
    """Through hpc.rank.timeline as rank 0 of a local run uses it: a first start, a stop at step 10
    (its checkpoint commits now), then the new launch that resumed from it."""
    now = time.time()
    steps = [{"step": n, "time": now - 20 + n, "step_ms": 1000.0} for n in range(1, 11)]  # step 10 ten seconds ago
    run = RunDir(tmp_path)
    Timeline(run, {}, now - 30).record_start({"loaded": now - 22, "load_s": 0.5, "first_step": now - 19, "resumed_from": None})
    run.steps.write_text("".join(json.dumps(row) + "\n" for row in steps))
    Timeline(run, {}, now - 30).record_stop("SIGUSR1", now - 10.4, "training", "preemption", 10)
    Timeline(run, {}, now + 5).record_start({"loaded": now + 9, "load_s": 1.0, "first_step": now + 9.5, "resumed_from": 10})
    first, stop, resumed = read_jsonl(tmp_path / TIMELINE)
    assert "cost" not in first and (stop["event"], stop["agreed"]) == ("stop", now - 10)
    cost = resumed["cost"]
    assert (cost["cause"], cost["how"], cost["redone_steps"]) == ("SIGUSR1 (preemption)", "a new launch", 0)
    assert cost["to_stop_s"] == pytest.approx(0.4) and cost["total_s"] == pytest.approx(19.9)
    assert cost["start_up_s"] == pytest.approx(3.0) and cost["load_s"] == 1.0


def test_a_stop_rank_0_heard_of_from_another_rank_begins_no_later_than_the_agreement(tmp_path: Path):
    """Rank 0's own signal came during the save after the step the ranks agreed on: the stop had
    reached some rank by that step, so the cost counts from there, not from rank 0's signal."""
    now = time.time()
    run = RunDir(tmp_path)
    run.steps.write_text("".join(json.dumps({"step": n, "time": now - 20 + n, "step_ms": 1000.0}) + "\n" for n in range(1, 11)))
    Timeline(run, {}, now - 30).record_stop("SIGTERM", now - 9.8, "the final save", "requeue in progress", 10)
    (stop,) = read_jsonl(tmp_path / TIMELINE)
    assert (stop["signal"], stop["received"], stop["agreed"]) == ("SIGTERM", now - 10, now - 10)


def test_a_timeline_that_cannot_be_written_or_read_costs_a_warning_never_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """The stop is recorded between result.json and the requeue, the start inside the training loop:
    a full disk or an edited record must not raise there (the requeue would be lost)."""
    unwritable = RunDir(tmp_path / "a")
    (unwritable.path / TIMELINE).mkdir(parents=True)  # appending to it raises IsADirectoryError
    Timeline(unwritable, {}, 0.0).record_stop("SIGUSR1", 1.0, None, "preemption", 0)
    edited = RunDir(tmp_path / "b")
    edited.path.mkdir()
    (edited.path / TIMELINE).write_text(json.dumps({"event": "start", "launched": "noon"}) + "\n")  # not a time
    Timeline(edited, {}, 0.0).record_start({"loaded": 2.0, "load_s": 1.0, "first_step": 3.0, "resumed_from": 0})
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all(w.startswith("interruption timeline not recorded: ") for w in warnings), warnings


@pytest.mark.parametrize(("exported", "decimal", "expected"), [(0.25, ".", 0.25), (0.25, ",", 0.25), (-10.0, ".", 0.0), (None, ".", 0.0)])
def test_a_requeued_start_counts_from_its_batch_scripts_first_line_not_an_earlier_one(tmp_path: Path, monkeypatch, exported, decimal, expected):
    """HPCTK_BATCH_STARTED (bash's $EPOCHREALTIME, a comma in some locales) is finer than Slurm's
    StartTime (whole seconds); one older than StartTime was inherited from an earlier job."""
    from hpc.env import BATCH_STARTED_VARIABLE
    from hpc.slurm import slurmctl

    fields = {"EligibleTime": "2026-12-02T10:00:00", "StartTime": "2026-12-02T10:00:10"}
    monkeypatch.setattr(slurmctl, "job_fields", lambda job, timeout_s=60: fields)
    slurm = datetime.fromisoformat(fields["StartTime"]).timestamp()
    env = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
    if exported is not None:
        env[BATCH_STARTED_VARIABLE] = f"{slurm + exported:.6f}".replace(".", decimal)
    Timeline(RunDir(tmp_path), env, slurm + 1).record_start({"loaded": slurm + 3, "load_s": 0.5, "first_step": slurm + 3.5, "resumed_from": 0})
    (started,) = read_jsonl(tmp_path / TIMELINE)
    assert started["slurm_started"] == slurm and started["job_started"] == pytest.approx(slurm + expected, abs=1e-3)
