"""Sweep expansion, grouping into arrays, and the one-line refusals of `launch.py -m`."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from hpc.config.compose import expand_sweep, sweep_points
from hpc.config.schema import JobConfig, ResourcesConfig
from hpc.errors import UserError
from hpc.launching.sweep import SweepPoint, sweep_groups
from tests.support.runs import ROOT


def test_grid_of_two_keys_gives_every_combination_in_order():
    points = expand_sweep(["optim.lr=0.1,0.2", "model=mlp,cnn", "trainer.epochs=1"])
    # The first key varies slowest, as in Hydra's BasicSweeper: job numbers follow this order.
    assert points == [
        ["optim.lr=0.1", "model=mlp", "trainer.epochs=1"],
        ["optim.lr=0.1", "model=cnn", "trainer.epochs=1"],
        ["optim.lr=0.2", "model=mlp", "trainer.epochs=1"],
        ["optim.lr=0.2", "model=cnn", "trainer.epochs=1"],
    ]


def test_sweeper_params_from_config_join_the_command_line():
    points = expand_sweep(["optim.lr=0.1,0.2"], {"resources.nodes": "1,2,4"})
    assert len(points) == 6
    assert sorted({p[0] for p in points}) == ["resources.nodes=1", "resources.nodes=2", "resources.nodes=4"]


def test_empty_sweep_is_refused_naming_the_override():
    with pytest.raises(UserError, match=r"empty sweep: optim.lr=range\(1,1\)"):
        expand_sweep(["optim.lr=range(1,1)"])


def test_bad_syntax_is_one_line():
    with pytest.raises(UserError, match=r"no viable alternative at input '\[0\.1'") as err:
        expand_sweep(["optim.lr=[0.1"])
    assert "\n" not in str(err.value)


def test_points_with_the_same_script_share_an_array_and_shapes_split():
    def point(num: int, nodes: int) -> SweepPoint:
        return SweepPoint(num, (f"resources.nodes={nodes}",), replace(JobConfig(), resources=ResourcesConfig(nodes=nodes)))

    points = [point(0, 1), point(1, 2), point(2, 1), point(3, 4), point(4, 2)]
    groups = sweep_groups(points, lambda job: {"nodes": job.resources.nodes, "tasks": job.resources.tasks_per_node})
    assert [[p.num for p in g] for _, g in groups] == [[0, 2], [1, 4], [3]]
    assert [params["nodes"] for params, _ in groups] == [1, 2, 4]


def test_scaling_preset_expands_to_three_node_counts():
    jobs = [job for _, job in sweep_points(["experiment=scaling", "cluster=simulated"])]
    assert [job.resources.nodes for job in jobs] == [1, 2, 4] and {job.name for job in jobs} == {"scaling"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["optim.lrr=0.1,0.2"], "unknown key 'optim.lrr'"),
        (["optim.lr=range(1,1)"], "empty sweep"),
        (["optim.lr=0.1,0.2", "sweep.max_parallel=0"], "sweep.max_parallel=0 must be >= 1"),
        (["model=mlp,transformer"], "unknown option model=transformer"),
    ],
)
def test_launch_refuses_a_bad_sweep_with_one_line_and_submits_nothing(tmp_path, args, message):
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "-m", *args, "cluster=simulated", f"run_root={tmp_path / 'runs'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not list((tmp_path / "runs").rglob("sweep.json")) and not list((tmp_path / "runs").rglob("config.yaml"))


def test_a_dry_run_sweep_prints_the_arrays_and_submits_nothing(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "-m",
            "optim.lr=0.1,0.2",
            "resources.nodes=1,2",
            "cluster=simulated",
            "sweep.max_parallel=1",
            "dry_run=true",
            f"run_root={tmp_path / 'runs'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("# job array of 2 tasks") == 2 and done.stdout.count("#SBATCH --array=0-1%1") == 2
    assert "#   point #1: optim.lr=0.1 resources.nodes=2" in done.stdout and "dry run: nothing submitted" in done.stdout
    assert not list((tmp_path / "runs").rglob("*.yaml"))


COMPOSE_ONCE = """
import runpy, sys
import hpc.config.compose  # binds the real to_job_config for launch.py's own composition
import hpc.config.schema

def refuse(cfg):
    raise AssertionError("a sweep point was composed a second time")

if sys.argv[1] == "refuse":  # what the array launcher would call to turn a second composition into a config
    hpc.config.schema.to_job_config = refuse
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("second_compose", ["refuse", "allow"])
def test_each_sweep_point_is_composed_once_and_as_hydra_would(tmp_path, second_compose):
    # "refuse": the launcher must take launch.py's configs (composing again fails the run);
    # "allow": the same dry run with nothing patched prints the very same text.
    args = ["-m", "optim.lr=0.1,0.2", "experiment=scaling", "cluster=simulated", "dry_run=true", f"run_root={tmp_path / 'runs'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", COMPOSE_ONCE, second_compose, str(ROOT / "launch.py"), *args]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("#   point #") == 6 and "#   point #5: resources.nodes=4 optim.lr=0.2 " in done.stdout
    assert done.stdout.count("#SBATCH --nodes=") == 3  # one array per shape


def test_a_ctrl_c_during_a_local_sweep_stops_it_after_the_point_it_came_in(tmp_path, monkeypatch):
    import signal

    from hpc.config.compose import compose_job
    from hpc.launching import local, sweep

    ran: list[str] = []

    def interrupted_run(job, env, run_dir, info=None, code=None, stops=None):
        ran.append(run_dir.path.name)
        stops.append(signal.SIGINT)
        return 0  # it completed as the signal came

    monkeypatch.setattr(local, "run_local", interrupted_run)
    monkeypatch.setattr(sweep, "prepare_points", lambda points: list(points))
    monkeypatch.setattr(sweep, "write_point_dirs", lambda points, sweep_dir: None)
    job = compose_job([])
    lines: list[str] = []
    points = [SweepPoint(num, (f"optim.lr=0.{num + 1}",), job) for num in range(3)]
    assert sweep.launch_sweep(points, tmp_path, lines.append) == 128 + signal.SIGINT
    assert ran == ["0"]
    assert "interrupted: points #1, #2 not run" in lines, lines


def test_an_interrupted_local_sweep_keeps_its_unrun_points_in_sweep_json(tmp_path, monkeypatch):
    """`launch.py -m optim.lr=0.05,0.1`, Ctrl-C during point 0: sweep.json listed point 0 only,
    so hpc.status showed one row and hpc.resubmit named point #1 `(no overrides)`. Every local
    point is listed with its overrides before the first runs."""
    import json
    import signal

    from hpc.config.compose import compose_job
    from hpc.launching import local, sweep
    from hpc.tools.resubmit import resubmit
    from hpc.tools.status import statuses

    listed_while_running: list[list[dict]] = []

    def interrupted_run(job, env, run_dir, info=None, code=None, stops=None):
        listed_while_running.append(json.loads((tmp_path / "sweep.json").read_text())["points"])
        run_dir.write_json(run_dir.result, {"status": "stopped"})  # as a rank stopped by the Ctrl-C leaves it
        stops.append(signal.SIGINT)
        return 130

    monkeypatch.setattr(local, "run_local", interrupted_run)
    monkeypatch.setattr(sweep, "prepare_points", lambda points: list(points))
    job = compose_job([])
    points = [SweepPoint(num, (f"optim.lr=0.{num + 1}",), job) for num in range(3)]
    assert sweep.launch_sweep(points, tmp_path, lambda line: None) == 128 + signal.SIGINT
    expected = [{"num": n, "overrides": [f"optim.lr=0.{n + 1}"], "run_dir": str(tmp_path / str(n)), "job_id": None, "trial": None} for n in range(3)]
    assert listed_while_running == [expected]  # all of them before point 0 ran
    assert json.loads((tmp_path / "sweep.json").read_text())["points"] == expected
    assert [(s.run, s.swept) for s in statuses(tmp_path)] == [("0", "optim.lr=0.1"), ("1", "optim.lr=0.2"), ("2", "optim.lr=0.3")]
    lines: list[str] = []
    assert resubmit(tmp_path, dry_run=True, emit=lines.append) == 0
    assert lines == [
        "point #0 (optim.lr=0.1): STOPPED",
        "point #1 (optim.lr=0.2): UNKNOWN",
        "point #2 (optim.lr=0.3): UNKNOWN",
        "dry run: 3 points would be submitted again",
    ]


def test_a_sweeps_run_root_is_remembered_for_hpc_status(tmp_path, monkeypatch):
    """hpc.status with no dir named lists the runs under every run root used here: a sweep's too."""
    from dataclasses import replace

    from hpc.config.compose import compose_job
    from hpc.launching.sweep import SweepPoint, write_point_dirs
    from hpc.runroots import remembered

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    root = tmp_path / "scratch" / "runs"
    job = replace(compose_job([]), run_root=str(root))
    write_point_dirs([SweepPoint(0, ("optim.lr=0.1",), job)], root / "sweeps" / "s1")
    assert remembered() == [root]
