"""A user's task, in a package outside the toolkit, trained through launch.py on two MPI ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.runs import ROOT, resume_command

FIXTURE = ROOT / "tests" / "fixtures" / "mytasks"
pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]


def test_a_user_task_trains_on_two_mpi_ranks_through_launch(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "user" / "mytasks")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "user")}
    command = [
        sys.executable,
        str(ROOT / "launch.py"),
        "task._target_=mytasks.regression.Regression",
        "+task.tolerance=0.2",
        "trainer.epochs=2",
        "data.batch_size=16",
        "data.eval_batch_size=16",
        "optim.lr=0.2",
        "optim.momentum=0",
        f"run_root={tmp_path / 'runs'}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = [p.parent for p in (tmp_path / "runs").glob("*/*/config.yaml")]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 * 512 // 32 and all("close" in s for s in steps)
    assert [e["epoch"] for e in epochs] == [1, 2] and "val_close" in epochs[-1] and epochs[-1]["val_loss"] < steps[0]["loss"]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["world_size"] == 2 and result["val_metrics"]["close"] == epochs[-1]["val_close"]


def test_the_user_package_is_frozen_with_the_run_and_resumed_from_the_copy(tmp_path):
    user = tmp_path / "user"
    shutil.copytree(FIXTURE, user / "mytasks")
    env = {**os.environ, "PYTHONPATH": str(user)}
    overrides = ["task._target_=mytasks.regression.Regression", "trainer.max_steps=5", "checkpoint.every_steps=5", f"run_root={tmp_path / 'runs'}"]
    first = subprocess.run([sys.executable, str(ROOT / "launch.py"), *overrides], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    (run_dir,) = [p.parent for p in (tmp_path / "runs").glob("*/*/config.yaml")]
    frozen = run_dir / "code" / "mytasks" / "regression.py"
    assert frozen.read_text() == (FIXTURE / "regression.py").read_text()
    assert json.loads((run_dir / "code" / "SOURCE.json").read_text())["user"] == [str(user / "mytasks")]
    # The package changes where it lies (a user edits it while jobs wait): the run goes on with its copy.
    (user / "mytasks" / "regression.py").write_text('raise RuntimeError("the live copy was imported")\n')
    command, resume_env = resume_command(run_dir)
    again = subprocess.run(command, capture_output=True, text=True, env=resume_env, timeout=300, cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resumed from checkpoint step 5" in (run_dir / "logs" / "rank-00000.log").read_text()
