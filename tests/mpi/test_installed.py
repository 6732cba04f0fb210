"""The toolkit installed as a package: `pip install` of this checkout into a fresh virtualenv
outside it, then the README's first job and its user task run from a user's project directory
with the installed `hpc-launch` (its configs the package's own, no checkout on any path)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.docs import marked_blocks
from tests.support.runs import ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

LEFT_OUT = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", ".mypy_cache", ".ruff_cache", ".pytest_cache", "tests", "docs", "examples")


def readme_task() -> tuple[str, list[str]]:
    """The README's own task (### Your own task): its Python file and its commands, the same as
    docs/your-code.md shows."""
    code, commands = (block.body for block in marked_blocks("README.md", __file__))
    assert [b.body for b in marked_blocks("docs/your-code.md", __file__)] == [code, commands], "README.md and docs/your-code.md show different tasks"
    return code, commands.strip().splitlines()


def test_the_installed_command_runs_the_first_job_and_the_readme_task_from_a_project_dir(tmp_path):
    # A copy of the sources (pip builds in the source tree), built as pip builds any package (an
    # isolated build environment with the build-system requirements) and installed without its dependencies:
    # those are this machine's (--system-site-packages), the toolkit is the wheel's.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=LEFT_OUT)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    shutil.rmtree(source)  # nothing may come from the sources now
    project = tmp_path / "project"
    project.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = subprocess.run(["python", "-c", "import hpc, trainers.tasks; print(hpc.__file__)"], cwd=project, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr

    # The first job: the embedded default, one epoch
    first = subprocess.run(["hpc-launch", "trainer.epochs=1", "run_root=runs/first"], cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    (run_dir,) = [p.parent for p in (project / "runs" / "first").glob("*/*/config.yaml")]
    assert json.loads((run_dir / "result.json").read_text())["val_metrics"]["accuracy"] > 0.3  # ten digits: chance is 0.1
    assert (run_dir / "code" / "hpc" / "conf" / "config.yaml").is_file()  # the installed toolkit, frozen with the run

    # The package's nested configs (hydra/sweeper/optuna.yaml and its samplers) came with it
    search = ["hpc-launch", "-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=random", "optim.lr=interval(0.01,0.1)", "sweep.objective=val_accuracy"]
    dry = subprocess.run([*search, "dry_run=true"], cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "each trial returns sweep.objective=val_accuracy (maximize)" in dry.stdout, dry.stdout + dry.stderr

    # The README's task, written and run as it says
    code, commands = readme_task()
    (project / "mypkg").mkdir()
    (project / "mypkg" / "tasks.py").write_text(code)
    assert commands[0] == "touch mypkg/__init__.py"
    (project / "mypkg" / "__init__.py").touch()
    words = commands[1].split()
    assert words[:2] == ["PYTHONPATH=$PWD", "hpc-launch"]
    task = subprocess.run(
        ["hpc-launch", *words[2:], "trainer.epochs=1", "run_root=runs/task"],
        cwd=project,
        env={**env, "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert task.returncode == 0, task.stdout[-2000:] + task.stderr[-2000:]
    (run_dir,) = [p.parent for p in (project / "runs" / "task").glob("*/*/config.yaml")]
    epochs = [moment for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "epoch" in (moment := json.loads(line))]  # not the test split's, last
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 1024 // (2 * 32) and epochs[-1]["val_loss"] < 0.5 * steps[0]["loss"] and "val_close" in epochs[-1]
