"""hpc.status and hpc.report on crafted run directories with known numbers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from hpc.launching.launchers import QueuedJob
from hpc.rundir import RunDir, find_runs, last_record
from hpc.slurm import slurmctl
from hpc.tools.report import scaling_figures
from hpc.tools.status import queued_jobs, run_status, statuses
from tests.support.runs import ROOT, holding


def _jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(root, name, ranks, rates, accuracy=0.9):
    run = RunDir(root / name)
    run.path.mkdir(parents=True)
    run.config.write_text("name: train\n")
    _jsonl(run.metrics, [{"epoch": i + 1, "samples_per_s": r, "world_size": ranks, "val_accuracy": accuracy, "loss": 0.5} for i, r in enumerate(rates)])
    _jsonl(run.steps, [{"step": s, "loss": 1.0 / s, "samples_per_s": rates[-1]} for s in range(1, 11)])
    return run


def _sweep(sweep, points):
    """A sweep dir whose points carry their overrides, as launch.py -m writes them."""
    record = {"points": [{"num": i, "run_dir": str(run.path), "overrides": overrides} for i, (run, overrides) in enumerate(points)]}
    sweep.mkdir(parents=True, exist_ok=True)
    (sweep / "sweep.json").write_text(json.dumps(record))


def test_speedup_and_efficiency_from_crafted_metrics(tmp_path):
    # Steady rates (first epoch left out): 2 ranks 100 and 140 (base = their mean, 120),
    # 4 ranks 180, 8 ranks 300. Worked by hand: speedups 100/120, 140/120, 180/120 = 1.5,
    # 300/120 = 2.5; efficiencies = speedup / (ranks / 2): 1.5 / 2 = 0.75, 2.5 / 4 = 0.625.
    runs = [
        _run(tmp_path, "0", 2, [50, 100, 100]),
        _run(tmp_path, "1", 2, [7, 130, 150]),
        _run(tmp_path, "2", 4, [10, 170, 190]),
        _run(tmp_path, "3", 8, [1, 300]),
    ]
    figures = {f.run: f for f in scaling_figures(runs)}
    assert figures["0"].samples_per_s == pytest.approx(100) and figures["1"].samples_per_s == pytest.approx(140)
    assert (figures["0"].speedup, figures["0"].efficiency) == (pytest.approx(5 / 6), pytest.approx(5 / 6))
    assert (figures["1"].speedup, figures["1"].efficiency) == (pytest.approx(7 / 6), pytest.approx(7 / 6))
    assert (figures["2"].speedup, figures["2"].efficiency) == (pytest.approx(1.5), pytest.approx(0.75))
    assert (figures["3"].speedup, figures["3"].efficiency) == (pytest.approx(2.5), pytest.approx(0.625))


def test_report_command_writes_table_and_plots(tmp_path):
    sweep = tmp_path / "sweep"
    runs = [_run(sweep, "0", 1, [100, 100]), _run(sweep, "1", 2, [100, 150])]
    _sweep(sweep, [(runs[0], ["resources.tasks_per_node=1", "trainer.epochs=2"]), (runs[1], ["resources.tasks_per_node=2", "trainer.epochs=2"])])
    done = subprocess.run([sys.executable, "-m", "hpc.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # 150 samples/s on 2 ranks against 100 on 1: speedup 1.5, efficiency 1.5 / 2 = 0.75.
    assert "| run | ranks | nodes | resources.tasks_per_node | samples/s | speedup | efficiency | val accuracy | loss |" in done.stdout
    assert "| 1 | 2 | - | 2 | 150.0 | 1.50 | 0.75 | 0.9000 | 0.5000 |" in done.stdout
    for name in ("report.md", "report.json", "scaling.png", "loss.png"):
        assert (sweep / name).stat().st_size > 0
    written = json.loads((sweep / "report.json").read_text())[1]
    assert (written["efficiency"], written["label"]) == (pytest.approx(0.75), "resources.tasks_per_node=2")


def test_a_report_into_a_closed_pipe_writes_its_files_without_a_traceback(tmp_path):
    """`python -m hpc.report DIR | head` (the reader gone before the report is printed): the
    files are written, stderr is quiet, exit 0."""
    sweep = tmp_path / "sweep"
    runs = [_run(sweep, str(i), 1, [100, 100 + i]) for i in range(2)]
    _sweep(sweep, [(run, [f"optim.lr={i}"]) for i, run in enumerate(runs)])
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write fails with EPIPE, whenever it comes
    try:
        done = subprocess.run([sys.executable, "-m", "hpc.report", str(sweep)], cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (0, "") and (sweep / "report.md").stat().st_size > 0 and (sweep / "loss.png").exists()


def test_a_sweep_on_equal_ranks_is_labelled_by_its_values_and_has_no_scaling_figures(tmp_path):
    sweep = tmp_path / "sweep"
    lrs = ["0.01", "0.05", "0.1", "0.5"]
    runs = [_run(sweep, str(i), 2, [100, 90 + i], accuracy=0.5 + i / 10) for i in range(4)]
    _sweep(sweep, [(run, [f"optim.lr={lr}", "cluster=local"]) for run, lr in zip(runs, lrs, strict=True)])
    (sweep / "scaling.png").write_text("from an earlier report")
    done = subprocess.run([sys.executable, "-m", "hpc.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert table[0] == "| run | ranks | nodes | optim.lr | samples/s | val accuracy | loss |"
    assert table[2:] == [f"| {i} | 2 | - | {lr} | {90 + i:.1f} | {0.5 + i / 10:.4f} | 0.5000 |" for i, lr in enumerate(lrs)]
    assert "every run has 2 ranks: no speedup, efficiency or scaling plot" in done.stdout
    assert not (sweep / "scaling.png").exists() and (sweep / "loss.png").stat().st_size > 0
    written = json.loads((sweep / "report.json").read_text())
    assert [(f["label"], f["speedup"], f["efficiency"]) for f in written] == [(f"optim.lr={lr}", None, None) for lr in lrs]


def test_status_of_a_sweep_shows_its_swept_values_and_no_rate_while_pending(tmp_path):
    sweep = tmp_path / "sweep"
    runs = [_run(sweep, str(i), 2, [100, 250]) for i in range(2)]
    _sweep(sweep, [(run, [f"optim.lr={lr}", "model=mlp"]) for run, lr in zip(runs, ["0.1", "0.2"], strict=True)])
    for i, run in enumerate(runs):
        run.write_json(run.job, {"job_id": f"5_{i}"})
    found = statuses(sweep)
    assert [s.swept for s in found] == ["optim.lr=0.1", "optim.lr=0.2"]
    queued = {"5_0": QueuedJob("RUNNING"), "5_1": QueuedJob("PENDING", 1, "BeginTime")}
    running, pending = (run_status(run, queued, s.swept) for run, s in zip(runs, found, strict=True))
    assert running.line(12).split()[:7] == ["5_0", "optim.lr=0.1", "RUNNING", "0", "10", "-", "250samples/s"]
    assert pending.line(12).split()[:7] == ["5_1", "optim.lr=0.2", "PENDING(BeginTime)", "1", "10", "-", "-"]
    listing = subprocess.run([sys.executable, "-m", "hpc.status", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    # Each run named by its place under the listed dir (issue 45: no run-name column)
    assert [line.split()[:3] for line in listing.stdout.splitlines()] == [["job", "run", "swept"], ["5_0", "0", "optim.lr=0.1"], ["5_1", "1", "optim.lr=0.2"]]


def test_status_json_gives_scripts_every_runs_fields(tmp_path, capsys, monkeypatch):
    from hpc.tools import status as status_module

    sweep = tmp_path / "sweep"
    runs = [_run(sweep, str(i), 2, [100, 250]) for i in range(2)]
    _sweep(sweep, [(run, [f"optim.lr={lr}"]) for run, lr in zip(runs, ["0.1", "0.2"], strict=True)])
    runs[0].write_json(runs[0].job, {"job_id": "5_0"})
    monkeypatch.setattr(slurmctl, "job_records", lambda ids: {"5_0": {"JobState": "PENDING", "Reason": "Dependency"}})
    monkeypatch.setattr(slurmctl, "accounting_states", lambda ids: {})
    assert status_module.main([str(sweep), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["run"], r["job_id"], r["state"], r["reason"], r["swept"], r["last_step"]) for r in listed] == [
        ("0", "5_0", "PENDING", "Dependency", "optim.lr=0.1", 10),
        ("1", None, listed[1]["state"], "", "optim.lr=0.2", 10),
    ]
    assert listed[0]["run_dir"] == str(runs[0].path) and listed[0]["search"] is None and listed[0]["samples_per_s"] == 250.0
    assert status_module.main([str(sweep), "--json", "--watch"]) == 2
    assert "error: --json lists once: drop --watch" in capsys.readouterr().err


def test_status_of_a_local_run_reads_the_run_dir(tmp_path, monkeypatch):
    run = _run(tmp_path, "r", 2, [100])
    for step, committed in ((10, True), (20, True), (30, False)):  # step 30: a save that never committed
        (run.checkpoints / f"step-{step:09d}").mkdir(parents=True)
        if committed:
            (run.checkpoints / f"step-{step:09d}" / "COMMITTED").write_text("{}")
    run.write_json(run.job, {"launcher": "local", "pid": os.getpid(), "host": socket.gethostname()})
    status = run_status(run, {})
    assert (status.state, status.last_step, status.checkpoint_step, status.samples_per_s) == ("RUNNING", 10, 20, 100.0)
    run.write_json(run.result, {"status": "stopped", "restarts": 2})
    assert run_status(run, {}).state == "STOPPED"
    # Ranks of a start from command.txt (the old result.json still there), or outliving a killed
    # launcher (its pid gone): they hold the run dir's lock, and the run is running
    run.write_json(run.job, {"launcher": "local", "pid": 2**22 + 1, "host": socket.gethostname()})
    rank = holding("hold_rank", run.path)
    try:
        assert run_status(run, {}).state == "RUNNING"
    finally:
        rank.kill()
        rank.wait()
    assert run_status(run, {}).state == "STOPPED"
    run.write_json(run.job, {"job_id": "77_3"})  # a Slurm job from before job.json named its launcher

    def slurm_says(accounting: dict[str, str] | None = None, **fields: str) -> dict[str, QueuedJob]:
        monkeypatch.setattr(slurmctl, "job_records", lambda ids: {"77_3": fields} if fields else {})
        monkeypatch.setattr(slurmctl, "accounting_states", lambda ids: accounting or {})
        return queued_jobs([{"job_id": "77_3"}])

    running = slurm_says(JobState="RUNNING", Restarts="1")
    assert (run_status(run, running).state, run_status(run, running).restarts) == ("RUNNING", 2)  # result.json's 2: the larger
    assert run_status(run, slurm_says({"77_3": "TIMEOUT"})).state == "TIMEOUT"
    requeued = run_status(run, slurm_says(JobState="PENDING", Restarts="2", Reason="BeginTime"))
    assert (requeued.reason, requeued.line().split()[1:3]) == ("BeginTime", ["PENDING(BeginTime)", "2"])
    # Slurm's hold after a requeue, and until when (its EligibleTime)
    held = {"JobState": "PENDING", "Restarts": "2", "Reason": "BeginTime", "EligibleTime": "2026-12-02T06:01:10", "StartTime": "2026-12-02T06:01:10"}
    assert run_status(run, slurm_says(**held)).line().split()[1:5] == ["PENDING(requeue", "hold", "to", "06:01:10)"]
    assert run_status(run, slurm_says(**{**held, "Restarts": "0"})).reason == "begins 06:01:10"  # sbatch --begin: not a requeue
    assert run_status(run, slurm_says(JobState="PENDING", Reason="None")).line().split()[1] == "PENDING"
    assert run_status(run, slurm_says()).state == "STOPPED"  # Slurm forgot it: result.json tells


def test_dead_local_run_is_reported_as_died(tmp_path):
    run = _run(tmp_path, "r", 2, [100])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run.write_json(run.job, {"launcher": "local", "pid": dead.pid, "host": socket.gethostname()})
    assert run_status(run, {}).state == "DIED"


def test_runs_are_found_below_a_root_but_not_in_hydra_or_code_dirs(tmp_path):
    for name in ("a", "b/c", "a/.hydra", "s/code/conf"):
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / name / "config.yaml").write_text("x: 1\n")
    assert [r.path.relative_to(tmp_path).as_posix() for r in find_runs(tmp_path)] == ["a", "b/c"]
    assert [s.run_dir for s in statuses(tmp_path / "a")] == [tmp_path / "a"]


def test_runs_are_listed_in_numeric_order(tmp_path):
    for name in ("sweep/10", "sweep/2", "sweep/1", "other"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "config.yaml").write_text("x: 1\n")
    assert [r.path.relative_to(tmp_path).as_posix() for r in find_runs(tmp_path)] == ["other", "sweep/1", "sweep/2", "sweep/10"]


def test_last_record_skips_a_line_being_written(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert last_record(path) == {"step": 2}
    assert last_record(tmp_path / "missing.jsonl") is None


@pytest.mark.parametrize("module", ["hpc.status", "hpc.report"])
def test_a_directory_without_runs_is_one_line_and_exit_2(tmp_path, module):
    done = subprocess.run([sys.executable, "-m", module, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {tmp_path} holds no runs (no sweep.json, and no run dir in it or below it)"


def test_array_task_ranges_of_pending_tasks_expand():
    from hpc.slurm.slurmctl import array_task_ids

    assert array_task_ids("0-3%2") == [0, 1, 2, 3]
    assert array_task_ids("3,5-7") == [3, 5, 6, 7]
    assert array_task_ids("4") == [4]
    assert array_task_ids("N/A") == []


def test_the_report_shows_a_user_tasks_own_validation_metrics(tmp_path):
    from hpc.tools.report import render_table

    run = RunDir(tmp_path / "0")
    run.path.mkdir(parents=True)
    epoch = {"epoch": 1, "samples_per_s": 50.0, "world_size": 2, "loss": 0.01, "val_loss": 0.02, "val_within_3_sigma": 0.97, "val_perplexity": 4.5}
    _jsonl(run.metrics, [epoch])
    (figures,) = scaling_figures([run])
    assert figures.val == {"within_3_sigma": 0.97, "perplexity": 4.5}  # not the val loss: the loss column is training's
    table = render_table([figures]).splitlines()
    assert table[0] == "| run | ranks | nodes | samples/s | val within 3 sigma | val perplexity | loss |"
    assert table[2] == "| 0 | 2 | - | 50.0 | 0.9700 | 4.5000 | 0.0100 |"
    # A run written before the validation split was named keeps test_ keys: read as validation.
    old = RunDir(tmp_path / "old")
    old.path.mkdir(parents=True)
    _jsonl(old.metrics, [{key.replace("val_", "test_"): value for key, value in epoch.items()}])
    assert scaling_figures([old])[0].val == figures.val


def test_status_shows_the_last_steps_loss_and_the_tasks_own_metric_names(tmp_path):
    user, builtin = _run(tmp_path, "0", 2, [100]), _run(tmp_path, "1", 2, [100])
    _jsonl(
        user.steps,
        [{"time": 1795491712.26, "step": 7, "epoch": 1, "loss": 0.0123456, "samples_per_s": 90.0, "step_ms": 3.0, "close": 0.75, "within_3_sigma": 1.0}],
    )
    _jsonl(builtin.steps, [{"step": 3, "epoch": 1, "loss": 0.5, "samples_per_s": 90.0, "accuracy": 0.875}])
    assert run_status(user, {}).metrics == "loss=0.01235 close=0.75 within_3_sigma=1 val_accuracy=0.9"  # the newest validation after
    listing = subprocess.run([sys.executable, "-m", "hpc.status", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    header, first, second = listing.stdout.splitlines()
    assert header.split()[6:9] == ["rate", "metrics", "log"]
    assert first.split()[7:10] == ["loss=0.01235", "close=0.75", "within_3_sigma=1"] and second.split()[7:9] == ["loss=0.5", "accuracy=0.875"]
    assert [line.split()[1] for line in (first, second)] == ["0", "1"]


def test_status_of_a_script_run_counts_restarts_as_interruptions_and_shows_its_rate_and_validation(tmp_path):
    """A script's steps (hpc.run) carry step_ms and, when it reports a count to end_step(), a rate
    in its unit; a local run relaunched twice has restarts 2, beside its 2 interruptions."""
    run = RunDir(tmp_path / "script")
    run.path.mkdir()
    run.config.write_text("name: train\n")
    _jsonl(run.steps, [{"step": s, "loss": 2.0, "step_ms": ms} for s, ms in enumerate([400.0, 250.0, 200.0, 260.0, 9000.0], start=1)])
    _jsonl(run.metrics, [{"step": 3, "val_loss": 1.5}, {"step": 5, "val_loss": 1.25, "val_ppl": 3.5}, {"step": 5, "peak_memory_mib": [80, 81]}])
    cost = {"total_s": 3.0, "held_s": None, "queued_s": None, "redone_steps": 1}
    _jsonl(run.path / "timeline.jsonl", [{"event": "start"}, {"event": "stop"}, {"event": "start", "cost": cost}, {"event": "start", "cost": cost}])
    status = run_status(run, {})
    assert (status.restarts, status.interrupted.split(":")[0]) == (2, "2 interruptions")
    assert status.rate == "3.846steps/s" and status.metrics == "loss=2 val_loss=1.25 val_ppl=3.5"  # the median of 5 step times: 260 ms
    _jsonl(run.steps, [{"step": 6, "loss": 2.0, "step_ms": 100.0, "tokens_per_s": 81920.0}])
    assert run_status(run, {}).rate == "81920tokens/s"
    run.write_json(run.job, {"job_id": "9"})
    requeued = run_status(run, {"9": QueuedJob("PENDING", 1)})
    assert (requeued.restarts, requeued.rate) == (2, "-")  # the timeline knew of a restart inside the allocation; no rate while pending


def test_watch_lists_again_until_no_run_is_running(tmp_path):
    """`hpc.status --watch` (issue 45): a listing every interval while a run runs, and an exit
    of its own once the run has ended; a bad interval is one line and exit 2."""
    run = _run(tmp_path, "r", 2, [100])
    run.write_json(run.job, {"launcher": "local", "pid": os.getpid(), "host": socket.gethostname()})  # alive: this test
    watcher = subprocess.Popen([sys.executable, "-m", "hpc.status", "--watch", "0.2", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout is not None
        running = 0
        while running < 2:  # two listings of the running run: it lists again
            line = watcher.stdout.readline()
            assert line, "the watcher ended while the run was running"
            running += " RUNNING " in line
        run.write_json(run.result, {"status": "completed"})
        rest, _ = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0 and rest.rstrip().splitlines()[-1].split()[:3] == ["local", "r", "COMPLETED"]
    bad = subprocess.run([sys.executable, "-m", "hpc.status", "--watch", "0", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (bad.returncode, bad.stderr.strip()) == (2, "error: --watch 0: give a number of seconds above 0")


@pytest.mark.parametrize(
    "argv",
    [["--watch", "{dir}"], ["--watch", "30", "{dir}"], ["{dir}", "--watch"], ["{dir}", "--watch", "0.5"]],
    ids=["watch-DIR", "watch-SECONDS-DIR", "DIR-watch", "DIR-watch-SECONDS"],
)
def test_watch_takes_the_readmes_and_the_docs_forms(tmp_path, capsys, argv):
    """`--watch RUN_DIR` (README: a plain flag) was refused as an invalid float; `--watch 30 DIR`
    (docs/sweeps.md) still sets the interval. The run has ended: one listing, then exit 0."""
    from hpc.tools import status as status_module

    run = _run(tmp_path, "r", 2, [100])
    run.write_json(run.result, {"status": "completed"})
    assert status_module.main([arg.format(dir=run.path) for arg in argv]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.splitlines()[-1].split()[:3] == ["local", "r", "COMPLETED"]


def test_watch_seconds_and_dir_are_told_apart():
    from hpc.errors import UserError
    from hpc.tools.status import watch_and_path

    assert watch_and_path("runs/x", None) == (10.0, "runs/x")
    assert watch_and_path("30", "runs/x") == (30.0, "runs/x")
    assert watch_and_path("10", None) == (10.0, "")  # no dir: runs/ here, else the run roots used (hpc.runroots)
    assert watch_and_path(None, None) == (None, "")
    for watch, path, message in (("x", "y", "--watch x: give a number of seconds"), ("inf", None, "--watch inf: give a number of seconds above 0")):
        with pytest.raises(UserError, match=message):
            watch_and_path(watch, path)


@pytest.mark.parametrize("module", ["hpc.status", "hpc.report"])
def test_an_empty_dir_argument_is_refused_not_taken_as_the_current_dir(tmp_path, capsys, monkeypatch, module):
    """`hpc.report "$SWEEP"` with SWEEP unset reported on the current dir and wrote its files there."""
    from hpc.tools import report, status

    run = _run(tmp_path, "r", 2, [100])
    run.write_json(run.result, {"status": "completed"})
    monkeypatch.chdir(run.path)  # a run here: an empty path read as "." would find it
    before = sorted(p.name for p in run.path.iterdir())
    main = status.main if module == "hpc.status" else report.main
    for argv in ([""], ["--watch", ""]) if module == "hpc.status" else ([""],):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("error: ") and "is empty (an unset shell variable?)" in captured.err
        assert len(captured.err.strip().splitlines()) == 1
    assert sorted(p.name for p in run.path.iterdir()) == before


def test_with_no_dir_named_it_lists_the_run_roots_used_here_hand_started_runs_too(tmp_path, monkeypatch):
    """No runs/ in the current dir: the runs under every run root launch.py (run_root=...) or a
    hand-started run handle used on this machine (hpc.runroots), a handle's run dir included."""
    from torch import nn

    from hpc.run import start_run
    from hpc.runroots import remember

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    run = start_run(tmp_path / "scratch" / "by-hand", model=nn.Linear(2, 1))  # as under torchrun with HPCTK_RUN_DIR
    run.finish()
    elsewhere = RunDir(tmp_path / "big" / "runs" / "2026-12-02" / "10-00-00_train")  # launch.py's, run_root=big/runs
    elsewhere.path.mkdir(parents=True)
    elsewhere.config.write_text("name: train\n")
    elsewhere.write_json(elsewhere.result, {"status": "failed"})
    remember(tmp_path / "big" / "runs")
    (tmp_path / "here").mkdir()
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}
    listed = subprocess.run([sys.executable, "-m", "hpc.status"], cwd=tmp_path / "here", env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()[1:]
    assert [(line.split()[1], "by-hand" in line, "10-00-00_train" in line) for line in lines] == [("FAILED", False, True), ("COMPLETED", True, False)]
    env["XDG_STATE_HOME"] = str(tmp_path / "none")
    nothing = subprocess.run([sys.executable, "-m", "hpc.status"], cwd=tmp_path / "here", env=env, capture_output=True, text=True, timeout=60)
    assert nothing.returncode == 2 and nothing.stderr.startswith("error: no runs/ here, and no run root used on this machine holds runs")
