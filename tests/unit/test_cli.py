"""launch.py as users type it: help, config printing, dry runs, and one-line errors."""

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.support.runs import ROOT, run_dirs, run_launch


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_help_lists_the_config_groups(tmp_path):
    result = run_launch("--help", cwd=tmp_path)
    assert result.returncode == 0
    for group in ("cluster", "resources", "comm", "model", "data", "optim", "trainer", "checkpoint", "topology"):
        assert f"{group}:" in result.stdout


def test_cfg_job_prints_config_without_running(tmp_path):
    result = run_launch("--cfg", "job", "optim.lr=0.3", cwd=tmp_path)
    assert result.returncode == 0 and "lr: 0.3" in result.stdout
    assert run_dirs(tmp_path) == []


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("optim.lrr=0.1", ["unknown key 'optim.lrr'", "lr, momentum"]),
        ("model=nope", ["unknown option model=nope", "cnn, mlp"]),
        ("resources.nodes=0", ["resources.nodes=0 must be >= 1"]),
        ("resources.tasks_per_node=0", ["resources.tasks_per_node=0 must be >= 1"]),
        ("resources.nodes=x", ["resources.nodes"]),
        # `optim.lr=0.05, 0.1` in a shell: the override Hydra cannot parse is named, with the way to write a sweep
        ("optim.lr=0.05,", ["override 'optim.lr=0.05,': ", "separated by commas without spaces (optim.lr=0.05,0.1,0.2)"]),
    ],
)
def test_bad_overrides_fail_in_one_line(tmp_path, override, fragments):
    assert_one_line_error(run_launch(override, cwd=tmp_path), *fragments)
    assert not (tmp_path / "runs").exists() or run_dirs(tmp_path) == []


def test_a_sweep_split_by_a_space_names_its_override_and_a_sweep_of_one_point_says_so(tmp_path):
    assert_one_line_error(run_launch("-m", "optim.lr=0.05,", "0.1,0.2", cwd=tmp_path), "override 'optim.lr=0.05,': ", "without spaces")
    one = run_launch("-m", "dry_run=true", "cluster=simulated", "optim.lr=0.1", cwd=tmp_path)
    assert one.returncode == 0 and "note: -m with one point is a sweep of one" in one.stderr, one.stderr
    two = run_launch("-m", "dry_run=true", "cluster=simulated", "optim.lr=0.1,0.2", cwd=tmp_path)
    assert two.returncode == 0 and "note: -m" not in two.stderr, two.stderr


def test_more_tasks_than_cluster_cpus_is_refused_before_submission(tmp_path):
    result = run_launch("cluster=simulated", "resources.tasks_per_node=5", cwd=tmp_path)
    assert_one_line_error(result, "5 tasks x 1 CPUs per node = 5 > the 4 CPUs")


def test_a_time_limit_the_stop_signal_would_come_before_is_refused(tmp_path):
    """1 minute with the signal 120 s before the limit: Slurm would signal each start at once,
    and the job would stop and requeue forever without training (issue 45)."""
    result = run_launch("cluster=simulated", "resources.time_min=1", cwd=tmp_path)
    assert_one_line_error(result, "resources.time_min=1 (60 s) leaves no time before the stop signal", "raise resources.time_min above 2")
    allowed = run_launch("dry_run=true", "cluster=simulated", "resources.time_min=1", "cluster.signal_seconds=50", cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr


def test_bad_data_paths_are_refused(tmp_path):
    assert_one_line_error(run_launch(f"data.path={tmp_path}/missing.h5", cwd=tmp_path), "does not exist")
    (tmp_path / "notes.txt").write_text("hello")
    assert_one_line_error(run_launch(f"data.path={tmp_path}/notes.txt", cwd=tmp_path), "is not an HDF5 file")
    with h5py.File(tmp_path / "partial.h5", "w") as f:
        f["train/x"] = np.zeros((8, 4))
        f["train/y"] = np.zeros(8, dtype=int)
    assert_one_line_error(run_launch(f"data.path={tmp_path}/partial.h5", cwd=tmp_path), "the file has no validation split val/x (or test/x)")
    assert run_dirs(tmp_path) == []


def interpreter_dir(root: Path, *tools: str) -> Path:
    """A virtual environment whose bin/ holds this interpreter and the given fake tools: each
    records its arguments in <tool>.args so the test sees which one launch.py started."""
    venv.EnvBuilder(system_site_packages=True, symlinks=True).create(root)
    for tool in tools:
        record_tool(root / "bin" / tool)
    return root / "bin"


def record_tool(path: Path) -> None:
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{path}.args"\n')
    path.chmod(0o755)


def launch_with(python: Path, *overrides: str, cwd: Path, path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(path), "HOME": str(Path.home())}
    command = [str(python), str(ROOT / "launch.py"), *overrides, f"run_root={cwd / 'runs'}"]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_missing_launch_tools_are_named(tmp_path):
    """No mpirun next to the interpreter (a virtualenv) and none on PATH."""
    bin_dir = interpreter_dir(tmp_path / "venv")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    assert_one_line_error(launch_with(bin_dir / "python", cwd=tmp_path, path=empty), "mpirun not found")
    assert_one_line_error(launch_with(bin_dir / "python", "cluster=simulated", cwd=tmp_path, path=empty), "sbatch not found")
    assert run_dirs(tmp_path) == []


def test_the_mpirun_next_to_the_interpreter_wins_over_path(tmp_path):
    """A pip-installed Open MPI (or Debian's /usr/bin) puts mpirun beside python: that one runs."""
    bin_dir = interpreter_dir(tmp_path / "venv", "mpirun")
    on_path = tmp_path / "path-bin"
    on_path.mkdir()
    record_tool(on_path / "mpirun")
    result = launch_with(bin_dir / "python", cwd=tmp_path, path=on_path)
    assert result.returncode == 0, result.stderr
    assert not (on_path / "mpirun.args").exists()
    args = (bin_dir / "mpirun.args").read_text().split()
    assert args[:2] == ["-n", "2"] and str(bin_dir / "python") in args


def test_dry_run_prints_config_and_exact_sbatch_and_leaves_nothing(tmp_path):
    result = run_launch("dry_run=true", "cluster=simulated", "resources.nodes=2", "resources.tasks_per_node=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "# resolved config" in out and "tasks_per_node: 2" in out
    assert "#SBATCH --nodes=2" in out and "#SBATCH --ntasks-per-node=2" in out and "--mpi=pmix" in out
    assert "export OMPI_MCA_btl_vader_backing_directory=/nodetmp" in out
    assert f"export THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '1')}" in out
    assert run_dirs(tmp_path) == [] and not list((tmp_path / "runs").rglob("*.yaml"))


def test_submit_path_never_imports_torch(tmp_path):
    """Login nodes: composing, checking and rendering a Slurm job must not pay torch's import."""
    probe = (
        "import atexit, sys, runpy\n"
        "atexit.register(lambda: print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH'))\n"
        f"sys.argv = ['launch.py', 'dry_run=true', 'cluster=simulated', 'run_root={tmp_path}/runs']\n"
        f"runpy.run_path({str(ROOT / 'launch.py')!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "NO_TORCH" in result.stdout


def test_a_hydra_plugin_that_fails_to_import_is_named_in_one_line(tmp_path):
    # As hydra-ax-sweeper 1.2.0 does on Python 3.11: Hydra imports every plugin first, so the
    # broken one would otherwise end every command, even a plain run, with a traceback.
    broken = tmp_path / "plugins" / "hydra_plugins" / "broken_sweeper"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ValueError('mutable default for field early_stop')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), str(ROOT)])}
    for command in ([], ["-m", "optim.lr=0.1,0.2"]):
        result = run_launch(*command, "dry_run=true", cwd=tmp_path, env=env)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.strip().splitlines() == [
            "error: the installed Hydra plugin hydra_plugins.broken_sweeper fails to import (ValueError: mutable default for field early_stop): "
            f"uninstall its package, or install a release that supports Python {sys.version_info.major}.{sys.version_info.minor}"
        ]


def test_hydras_flags_print_from_the_composition_the_job_would_run(tmp_path):
    """--cfg, --info, --version, --hydra-help: printed by hpc-launch itself (no hydra.main), each
    nothing more than it asks for, and nothing runs."""
    part = run_launch("--cfg", "job", "--package", "optim", "optim=adamw", cwd=tmp_path)
    assert part.returncode == 0 and part.stdout.startswith("# @package optim\nname: adamw\n"), part.stdout + part.stderr
    hydra = run_launch("--cfg", "hydra", "--resolve", cwd=tmp_path)  # its run dir names the job's run_root: resolved in the whole config
    assert hydra.returncode == 0 and f"dir: {tmp_path / 'runs'}/" in hydra.stdout and "subdir: ${hydra.job.num}" in hydra.stdout, hydra.stdout + hydra.stderr
    info = run_launch("--info", "defaults", "model=cnn", cwd=tmp_path)
    assert info.returncode == 0 and re.search(r"^model +cnn$", info.stdout, re.M) and re.search(r"^hydra/sweeper +basic$", info.stdout, re.M), info.stdout
    version = run_launch("--version", cwd=tmp_path)
    assert re.fullmatch(r"hpc-launch \S+ \(Hydra 1\.3\.\d+, omegaconf 2\.\d+\.\d+, submitit 1\.\d+\.\d+\)\n", version.stdout), version.stdout
    assert_one_line_error(run_launch("--cfg", "job", "--package", "optim.nope", cwd=tmp_path), "--package optim.nope: no such key")
    assert_one_line_error(run_launch("hydra/sweeper=nevergrad", cwd=tmp_path), "hydra/sweeper=nevergrad: hpc-launch runs grids")
    assert_one_line_error(run_launch("--info", "defaults-tree", cwd=tmp_path), "invalid choice: 'defaults-tree'")
    assert_one_line_error(run_launch("--experimental-rerun", "x.pickle", cwd=tmp_path), "not supported (it unpickles a file)")
    assert run_dirs(tmp_path) == []


def test_cfg_package_of_a_key_set_to_null_prints_null_and_only_a_missing_key_is_refused():
    """`--cfg job -p cluster.partition`: the key is there with value null (a user walking the
    README was told it did not exist); only a key that is not there is refused."""
    from omegaconf import OmegaConf

    from hpc.config.show import show_cfg
    from hpc.errors import UserError

    cfg = OmegaConf.create({"cluster": {"partition": None}, "optim": {"betas": None, "lr": 0.1, "todo": "???"}, "hydra": {"run": {"dir": "x"}}})
    assert show_cfg(cfg, "job", "cluster.partition", False) == "# @package cluster.partition\nnull"
    assert show_cfg(cfg, "job", "optim.betas", True) == "# @package optim.betas\nnull"
    assert show_cfg(cfg, "job", "optim.lr", False) == "# @package optim.lr\n0.1"
    assert show_cfg(cfg, "job", "optim.todo", False) == "# @package optim.todo\n???"
    for missing in ("optim.nope", "cluster.partition.name"):
        with pytest.raises(UserError, match=f"--package {missing}: no such key in the job config"):
            show_cfg(cfg, "job", missing, False)
