"""Sweeps on the real (simulated) Slurm: job arrays, the concurrency limit, status and report,
and the code a job runs frozen at submission, also on a cluster defaulting to --export=NONE."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks.simcluster import parse_job_id
from hpc.slurm.slurmctl import job_fields
from hpc.tools.status import statuses
from tests.conftest import wait_until_done
from tests.support.runs import ROOT, run_dirs

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.M)


def launch_sweep(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "-m", *args, f"run_root={cwd / 'runs'}"], cwd=cwd, capture_output=True, text=True, timeout=180
    )


def wait_for_sweep(sweep_dir: Path, timeout_s: float = 400) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [s.state for s in statuses(sweep_dir)]
        if all(state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") for state in states):
            return states
        time.sleep(1)  # polling Slurm: no completion event to wait on
    pytest.fail(f"sweep {sweep_dir} not done after {timeout_s} s: {[s.line() for s in statuses(sweep_dir)]}")


def active_interval(run_dir: Path) -> tuple[datetime, datetime]:
    """From the first to the last line of rank 0's log: when the task held its node."""
    stamps = LOG_TIME.findall((run_dir / "logs" / "rank-00000.log").read_text())
    return datetime.strptime(stamps[0], "%Y-%m-%d %H:%M:%S,%f"), datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f")


def most_at_once(intervals: list[tuple[datetime, datetime]]) -> int:
    return max(sum(1 for start, end in intervals if start <= moment <= end) for moment, _ in intervals)


def test_four_point_sweep_is_one_array_with_its_limit_and_status_and_report_see_it(tmp_path):
    done = launch_sweep(
        "optim.lr=0.05,0.1", "model=mlp,cnn", "sweep.max_parallel=2", "cluster=simulated", "resources.tasks_per_node=1", "trainer.epochs=1", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    (array_id,) = re.findall(r"submitted job array (\d+): 4 tasks \(points #0, #1, #2, #3\), at most 2 at once", done.stdout)
    sweep_dir = Path(re.search(r"sweep directory: (\S+)", done.stdout).group(1))
    assert job_fields(array_id).get("ArrayTaskThrottle") == "2"
    record = json.loads((sweep_dir / "sweep.json").read_text())
    assert [p["job_id"] for p in record["points"]] == [f"{array_id}_{i}" for i in range(4)]
    assert len(list((sweep_dir / "code" / "trainers").glob("*.py"))) > 5  # one frozen copy for all tasks

    status = subprocess.run([sys.executable, "-m", "hpc.status", str(sweep_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert [line.split()[0] for line in status.stdout.splitlines()[1:]] == [f"{array_id}_{i}" for i in range(4)]

    assert wait_for_sweep(sweep_dir) == ["COMPLETED"] * 4
    runs = [sweep_dir / str(i) for i in range(4)]
    configs = [(run / "config.yaml").read_text() for run in runs]
    assert sorted((re.search(r"lr: (\S+)", c).group(1), re.search(r"model:\n  name: (\S+)", c).group(1)) for c in configs) == [
        ("0.05", "cnn"),
        ("0.05", "mlp"),
        ("0.1", "cnn"),
        ("0.1", "mlp"),
    ]
    # Four 1-node tasks fit the 4-node cluster at once; the limit let at most 2 run together.
    assert most_at_once([active_interval(run) for run in runs]) <= 2
    final = subprocess.run([sys.executable, "-m", "hpc.status", str(sweep_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    for line in final.stdout.splitlines()[1:]:
        swept = r"optim\.lr=0\.(05|1)\s+model=(mlp|cnn)"
        metrics = r"loss=\S+ accuracy=\S+ val_accuracy=\S+ val_loss=\S+"  # the task's metric by its own name, then the newest validation
        memory = r"\(peak memory \d+ MiB \(rank \d\)\)"  # the ranks' highest peak
        assert re.match(rf"{array_id}_(\d)\s+\1\s+{swept}\s+COMPLETED\s+0\s+\d+\s+\d+\s+[\d.e+]+samples/s\s+{metrics}\s+\S+rank-00000.log  {memory}$", line), (
            line
        )

    # Slurm's stdout log of a task: plain timestamped progress lines, no progress bar.
    stdout = next((sweep_dir / "slurm").glob(f"{array_id}_0/*_0_log.out")).read_text()
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} step 10/\d+  loss ", stdout, re.M) and "\r" not in stdout, stdout[-1500:]

    report = subprocess.run([sys.executable, "-m", "hpc.report", str(sweep_dir)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    # Runs named by their swept values, best first by the validation accuracy they report, the
    # best marked; no speedup or scaling plot when the rank count never varies.
    rows = [line for line in report.stdout.splitlines() if re.match(r"\| \d( \(best\))? \| 1 \| 1 \| (0\.05|0\.1) \| (mlp|cnn) \|", line)]
    assert len(rows) == 4 and rows[0].startswith("| ") and " (best) |" in rows[0] and "(best)" not in "".join(rows[1:]), report.stdout
    accuracies = [float(row.split(" | ")[5]) for row in rows]  # the objective's column, after the swept keys
    assert accuracies == sorted(accuracies, reverse=True) and "| val_accuracy (maximize) |" in report.stdout, report.stdout
    assert not (sweep_dir / "scaling.png").exists() and (sweep_dir / "loss.png").stat().st_size > 0
    assert all(f["speedup"] is None and f["efficiency"] is None for f in json.loads((sweep_dir / "report.json").read_text()))


def test_scaling_preset_submits_one_array_per_shape_and_reports_efficiency(tmp_path):
    done = launch_sweep("experiment=scaling", "cluster=simulated", "resources.tasks_per_node=1", "trainer.epochs=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(re.findall(r"submitted job (\d+) \(point #\d\)", done.stdout)) == 3
    sweep_dir = Path(re.search(r"sweep directory: (\S+)", done.stdout).group(1))
    assert wait_for_sweep(sweep_dir) == ["COMPLETED"] * 3
    report = subprocess.run([sys.executable, "-m", "hpc.report", str(sweep_dir)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    figures = json.loads((sweep_dir / "report.json").read_text())
    assert [(f["ranks"], f["nodes"]) for f in figures] == [(1, 1), (2, 2), (4, 4)]
    # The arithmetic is the unit test's (hand-worked figures); here: it is there for varying ranks.
    assert figures[0]["efficiency"] == pytest.approx(1.0) and all(f["efficiency"] > 0 and f["speedup"] > 0 for f in figures[1:])
    assert (sweep_dir / "scaling.png").stat().st_size > 0


def test_a_job_runs_the_code_frozen_at_submission_even_under_export_none(tmp_path):
    project = tmp_path / "project"
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        if name.endswith((".py", ".yaml")):
            (project / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, project / name)
    # A site that defaults sbatch to --export=NONE: srun then passes no environment to ranks.
    env = {**os.environ, "SBATCH_EXPORT": "NONE"}
    done = subprocess.run(
        [sys.executable, "launch.py", "cluster=simulated", "resources.tasks_per_node=2", "trainer.epochs=1", "hold=true", f"run_root={tmp_path / 'runs'}"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    job_id = parse_job_id(done.stdout)
    assert job_fields(job_id).get("Reason") == "JobHeldUser"
    # Edited after submission: a job that imported the checkout would die at once.
    (project / "trainers" / "fit.py").write_text("raise SystemExit('edited after submission')\n")
    subprocess.run(["scontrol", "release", job_id], check=True)
    assert wait_until_done(job_id) == "COMPLETED"
    (run_dir,) = run_dirs(tmp_path)
    log = (run_dir / "logs" / "rank-00001.log").read_text()
    assert f"code: {run_dir / 'code'}" in log
    assert json.loads((run_dir / "code" / "SOURCE.json").read_text())["files"] > 20


def test_an_array_task_is_stopped_requeued_and_resumed_like_a_single_job(tmp_path):
    from benchmarks.simcluster import poll, release_when_requeued
    from tests.support.runs import logged_steps

    done = launch_sweep(
        "optim.lr=0.05,0.1",
        "cluster=simulated",
        "resources.tasks_per_node=1",
        "model.hidden_sizes=[512,512]",
        "trainer.epochs=3",
        "checkpoint.every_steps=5",
        "checkpoint.every_minutes=null",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    array_id = re.search(r"submitted job array (\d+): 2 tasks", done.stdout).group(1)
    sweep_dir = Path(re.search(r"sweep directory: (\S+)", done.stdout).group(1))
    task, run_dir = f"{array_id}_1", sweep_dir / "1"
    poll(lambda: logged_steps(run_dir) >= 9, "step 9 of array task 1")
    subprocess.run(["scancel", "--signal=USR1", task], check=True, capture_output=True)
    release_when_requeued(task, 0)
    assert wait_for_sweep(sweep_dir) == ["COMPLETED"] * 2
    result = json.loads((run_dir / "result.json").read_text())
    assert result["restarts"] == 1 and result["resumed_from"] >= 5
    assert json.loads((sweep_dir / "0" / "result.json").read_text())["restarts"] == 0  # its sibling ran through
    assert f"external signal: requeueing job {task}" in (run_dir / "logs" / "rank-00000.log").read_text()
    (line,) = [s for s in statuses(sweep_dir) if s.job_id == task]
    assert line.restarts == 1


def test_a_cancelled_point_is_resubmitted_alone_into_its_own_run_dir(tmp_path):
    """`python -m hpc.resubmit` (issue 45): the points that ended without completing go again,
    the completed ones stay, sweep.json and hpc.status name the new job."""
    from benchmarks.simcluster import poll

    done = launch_sweep("optim.lr=0.05,0.1", "cluster=simulated", "resources.tasks_per_node=1", "trainer.epochs=1", "hold=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    array_id = re.search(r"submitted job array (\d+): 2 tasks", done.stdout).group(1)
    sweep_dir = Path(re.search(r"sweep directory: (\S+)", done.stdout).group(1))
    subprocess.run(["scancel", f"{array_id}_0"], check=True, capture_output=True)
    subprocess.run(["scontrol", "release", f"{array_id}_1"], check=True, capture_output=True)
    # A cancelled task that never ran is UNKNOWN once Slurm forgets it (no accounting here, no result).
    poll(lambda: [s.state for s in statuses(sweep_dir)][1] == "COMPLETED", "point 1 completed", timeout_s=300)
    (cancelled,) = {s.state for s in statuses(sweep_dir) if s.job_id == f"{array_id}_0"}
    assert cancelled in ("CANCELLED", "UNKNOWN")

    def resubmit(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hpc.resubmit", str(sweep_dir), *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)

    dry = resubmit("--dry-run")
    assert dry.returncode == 0 and dry.stdout.splitlines() == [f"point #0 (optim.lr=0.05): {cancelled}", "dry run: 1 points would be submitted again"], dry
    again = resubmit()
    assert again.returncode == 0, again.stderr
    (new_id,) = re.findall(r"submitted job (\d+) \(point #0\)", again.stdout)
    subprocess.run(["scontrol", "release", new_id], check=True, capture_output=True)  # held as the sweep was
    assert wait_for_sweep(sweep_dir) == ["COMPLETED", "COMPLETED"]
    record = json.loads((sweep_dir / "sweep.json").read_text())
    assert [p["job_id"] for p in record["points"]] == [new_id, f"{array_id}_1"] and [a["job_id"] for a in record["arrays"]] == [array_id, new_id]
    assert [s.job_id for s in statuses(sweep_dir)] == [new_id, f"{array_id}_1"]
    assert json.loads((sweep_dir / "0" / "result.json").read_text())["status"] == "completed"
    assert resubmit().stdout.startswith("nothing to resubmit: every point of ")
