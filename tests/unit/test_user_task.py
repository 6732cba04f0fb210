"""A user's task named by `task._target_`: found on the login node without importing it (one
line when it is not there), built on the rank with the arguments its class declares, and
refused in one line when it breaks the contract."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.config.compose import compose_job
from hpc.config.validate import validate_job
from hpc.errors import UserError
from tests.support.runs import ROOT
from trainers.config import DataConfig, ModelConfig, TrainerConfig
from trainers.task import TaskError
from trainers.tasks import build_task

FIXTURE = ROOT / "tests" / "fixtures" / "mytasks"


@pytest.fixture
def user_path(tmp_path, monkeypatch) -> Path:
    """The fixture package copied outside the toolkit and put on the import path, as a user would."""
    shutil.copytree(FIXTURE, tmp_path / "mytasks")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_user_task_on_the_import_path_passes_the_login_checks(user_path):
    job = compose_job(["task._target_=mytasks.regression.Regression", "+task.samples=256"])
    assert job.task == {"_target_": "mytasks.regression.Regression", "samples": 256}
    assert validate_job(job) is None  # a user's data is known on the ranks only


@pytest.mark.parametrize(
    "target, message",
    [
        ("mytasks.regresion.Regression", r"task._target_=mytasks.regresion.Regression: no module 'mytasks.regresion' on the import path \("),
        ("nopkg.tasks.Thing", r"no module 'nopkg' on the import path .*put your package's parent directory on PYTHONPATH or pip install it"),
        ("mytasks.regression.Regresion", r"mytasks/regression.py defines no Regresion"),
        ("Regression", r"task._target_='Regression': name the class as package.module.Class"),
    ],
)
def test_a_task_that_cannot_be_found_is_one_line_on_the_login_node(user_path, target, message):
    with pytest.raises(UserError, match=message) as err:
        validate_job(compose_job([f"task._target_={target}"]))
    assert "\n" not in str(err.value)


def test_the_builtin_task_takes_no_arguments():
    with pytest.raises(UserError, match=r"task.width: the built-in classify task takes no arguments"):
        validate_job(compose_job(["+task.width=64"]))


def test_the_login_node_finds_the_task_without_importing_it(user_path):
    # mytasks/__init__.py imports torch: checking the target must not run it
    code = (
        "import sys\nfrom hpc.config.compose import compose_job\nfrom hpc.config.validate import check_task\n"
        "check_task(compose_job(['task._target_=mytasks.regression.Regression']))\n"
        "print('torch' in sys.modules, 'mytasks' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{user_path}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def provided() -> dict[str, object]:
    return {"model": ModelConfig(), "data": DataConfig(), "trainer": TrainerConfig(), "data_path": None}


def test_build_task_passes_the_config_keys_and_refuses_unknown_ones(user_path):
    task = build_task({"_target_": "mytasks.regression.Regression", "samples": 100}, provided())
    assert len(task.train_data()) == 100 and task.describe() == {"name": "Regression", "task": "mytasks.regression.Regression"}
    with pytest.raises(TaskError, match=r"task.width: mytasks.regression.Regression takes no argument 'width'; it takes: samples, tolerance, hidden"):
        build_task({"_target_": "mytasks.regression.Regression", "width": 3}, provided())
    with pytest.raises(TaskError, match=r"mytasks.regression.NotATask is not a task: it has no train_data, eval_data, train_step, eval_step"):
        build_task({"_target_": "mytasks.regression.NotATask"}, provided())
    with pytest.raises(TaskError, match=r"mytasks.regression defines no class Nope"):
        build_task({"_target_": "mytasks.regression.Nope"}, provided())


def test_keys_the_task_does_not_take_are_refused_on_the_login_node(user_path):
    with pytest.raises(UserError, match=r"task.width: mytasks.regression.Regression takes no argument 'width'; it takes: samples, tolerance, hidden"):
        validate_job(compose_job(["task._target_=mytasks.regression.Regression", "+task.width=3"]))
    assert validate_job(compose_job(["task._target_=mytasks.regression.Regression", "+task.tolerance=0.5"])) is None


def test_constructor_arguments_are_read_from_the_source():
    from hpc.config.validate import constructor_arguments

    source = (
        "import dataclasses\n"
        "class A:\n    def __init__(self, x, *, y=1): ...\n"
        "class B:\n    def __init__(self, **kw): ...\n"
        "@dataclasses.dataclass\nclass C:\n    width: int = 3\n    depth: int = 2\n"
        "class D(A): pass\n"
    )
    assert constructor_arguments(source, "A") == ["x", "y"]
    assert constructor_arguments(source, "B") is None  # takes anything
    assert constructor_arguments(source, "C") == ["width", "depth"]
    assert constructor_arguments(source, "D") is None  # inherited: the rank checks it
