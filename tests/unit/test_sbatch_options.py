"""Any sbatch option through cluster.sbatch (hpc.slurm.options, checked through SlurmLauncher.check): rendered as #SBATCH lines in the
script the job is submitted with, and every option the toolkit sets itself refused there in one
line naming the setting that owns it. On the real Slurm: tests/e2e/test_injection_slurm.py."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from hpc.config.schema import ClusterConfig, JobConfig
from hpc.config.validate import check_dependencies, check_script_values
from hpc.errors import UserError
from hpc.launching.launch import prepare
from hpc.rundir import RunDir
from hpc.slurm.batch import render_sbatch
from hpc.slurm.launcher import SlurmLauncher
from hpc.slurm.options import KNOWN, OWNED, sbatch_lines

CLUSTER = ClusterConfig(name="sim", launcher="slurm", partition="debug", cpus_per_node=4, max_nodes=4, time_min=20)


def script_with(tmp_path, **options) -> list[str]:
    job = JobConfig(cluster=replace(CLUSTER, sbatch=options), name="train")
    check_script_values(job)
    SlurmLauncher().check(job)
    return [line for line in render_sbatch(job, {}, RunDir(tmp_path / "run")).splitlines() if line.startswith("#SBATCH")]


def test_any_sbatch_option_becomes_its_line_true_a_flag_false_and_null_none(tmp_path):
    lines = script_with(tmp_path, **{"mail-type": "END", "exclusive": True, "reservation": None, "overcommit": False, "nice": 10, "wckey": "mine"})
    assert "#SBATCH --mail-type=END" in lines and "#SBATCH --exclusive" in lines and "#SBATCH --nice=10" in lines
    assert not any(("reservation" in line or "overcommit" in line) for line in lines)
    assert [line for line in lines if "--wckey" in line] == ["#SBATCH --wckey=mine"]  # replaces submitit's own wckey: one line
    assert lines.count("#SBATCH --signal=USR1@120") == 1 and "#SBATCH --requeue" in lines  # the toolkit's, untouched


@pytest.mark.parametrize("option", sorted(OWNED))
def test_every_option_the_toolkit_sets_is_refused_naming_the_setting_that_owns_it(option):
    with pytest.raises(UserError, match=rf"^cluster.sbatch.{option}: the toolkit sets --{option} itself; use {OWNED[option].split(' ')[0]}"):
        sbatch_lines({option: "x"})
    assert option in KNOWN  # each is a real sbatch option


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mail-typo": "END"}, r"^cluster.sbatch.mail-typo: sbatch has no option --mail-typo \(sbatch has --mail-type, --mail-user\)$"),
        ({"frobnicate": 1}, r"^cluster.sbatch.frobnicate: sbatch has no option --frobnicate$"),
        ({"Mail_Type": "END"}, r"^cluster.sbatch.Mail_Type: name sbatch's long option without dashes, e.g. cluster.sbatch.mail-type=END$"),
        ({"gres": ["gpu:1", "nic:1"]}, r"^cluster.sbatch.gres=\['gpu:1', 'nic:1'\]: give one value"),
        ({"comment": "a\nsrun evil"}, r"^cluster.sbatch.comment='a\\nsrun evil' contains a control character"),
    ],
)
def test_bad_options_are_refused_in_one_line_on_the_login_node(options, message):
    with pytest.raises(UserError, match=message):
        prepare(JobConfig(cluster=replace(CLUSTER, sbatch=options), dry_run=True))  # the login node's checks, through the plugin


@pytest.mark.parametrize(
    "after, after_any, line",
    [
        (123, None, "#SBATCH --dependency=afterok:123"),
        ([123, "124_2"], None, "#SBATCH --dependency=afterok:123:124_2"),
        ("123,124", 125, "#SBATCH --dependency=afterok:123:124,afterany:125"),
        (None, "7:8", "#SBATCH --dependency=afterany:7:8"),
    ],
)
def test_after_and_after_any_become_sbatchs_dependency(tmp_path, after, after_any, line):
    job = JobConfig(cluster=CLUSTER, name="train", after=after, after_any=after_any)
    lines = [entry for entry in render_sbatch(job, {}, RunDir(tmp_path / "run")).splitlines() if entry.startswith("#SBATCH --dependency")]
    assert lines == [line]


def test_a_dependency_is_refused_in_one_line_where_it_could_never_hold(monkeypatch):
    from hpc.launching import launch
    from hpc.launching.launch import check_waits
    from hpc.slurm import slurmctl

    with pytest.raises(UserError, match=r"^after='12x': name Slurm job ids, e.g. after=123 or after=\[123,124\]"):
        check_dependencies(JobConfig(cluster=CLUSTER, after="12x"))
    with pytest.raises(UserError, match=r"^after_any= holds a job until others end: it needs a Slurm cluster \(cluster=local runs at once, here\)$"):
        check_dependencies(JobConfig(after_any=5))
    with pytest.raises(UserError, match=r"^cluster.sbatch.dependency: the toolkit sets --dependency itself; use after= \(afterok\) and after_any="):
        sbatch_lines({"dependency": "afterok:5"})
    states = {"5": "FAILED", "6": "RUNNING"}
    monkeypatch.setattr(launch.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(slurmctl, "job_fields", lambda job_id: {"JobState": states[job_id]} if job_id in states else {})
    with pytest.raises(UserError, match=r"^after=5: job 5 ended FAILED, so this job would never start; use after_any=5 to run it anyway$"):
        check_waits(JobConfig(cluster=CLUSTER, after=[6, 5]))
    with pytest.raises(UserError, match=r"^after_any=9: Slurm knows no job 9 \(a typo, or it ended long enough ago to be forgotten\)$"):
        check_waits(JobConfig(cluster=CLUSTER, after_any=9))
    check_waits(JobConfig(cluster=CLUSTER, after=6, after_any=5))  # running, and failed but waited on in any state
    monkeypatch.setattr(launch.shutil, "which", lambda tool: None)
    check_waits(JobConfig(cluster=CLUSTER, after_any=9))  # away from the cluster (a dry run): the form alone is checked


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_a_container_wraps_the_ranks_alone_and_mounts_the_run_dir(tmp_path, runtime):
    """The srun line starts the image's python3 in the container; the batch script (its requeue
    and EXIT trap) and the step supervisor stay outside it."""
    cluster = replace(CLUSTER, container="img.sif" if runtime == "apptainer" else "nvcr.io#nvidia/pytorch:24.05-py3", container_runtime=runtime)
    cluster = replace(cluster, container_mounts=["/data:/data"])
    run_dir = RunDir(tmp_path / "run")
    script = render_sbatch(JobConfig(cluster=cluster, name="train"), {}, run_dir)
    (srun,) = [shlex.split(line.removeprefix("#   ")) for line in script.splitlines() if line.startswith("#   srun ")]
    mount = f"{run_dir.path}:{run_dir.path}"
    rank = ["python3", "-u", "-m", "hpc.rank.main", str(run_dir.path)]
    if runtime == "pyxis":
        assert srun[-7:] == ["--container-image=nvcr.io#nvidia/pytorch:24.05-py3", f"--container-mounts={mount},/data:/data", *rank]
    else:
        assert srun[-12:] == ["apptainer", "exec", "--bind", mount, "--bind", "/data:/data", "img.sif", *rank]
    # The script's own commands (its exports, EXIT trap, the supervisor's start) run on the host
    commands = [line for line in script.splitlines() if not line.startswith("#")]
    assert any(line.startswith("trap ") for line in commands) and not [line for line in commands if "--container-image" in line or "apptainer exec" in line]


def test_a_container_the_cluster_cannot_start_is_refused_in_one_line(monkeypatch):
    from hpc.config import validate
    from hpc.config.validate import check_container
    from hpc.launching.launchers import launchers
    from hpc.slurm import slurmctl

    with pytest.raises(UserError, match=r"^cluster.container=x.sif: the ranks start in a container through srun; use a Slurm cluster \(cluster=local runs"):
        check_container(JobConfig(cluster=replace(ClusterConfig(), container="x.sif")))
    with pytest.raises(UserError, match=r"^cluster.container_runtime='docker' must be pyxis"):
        check_container(JobConfig(cluster=replace(CLUSTER, container="x", container_runtime="docker")))
    with pytest.raises(UserError, match=r"^cluster.container_mounts='/a,/b': one path"):
        check_container(JobConfig(cluster=replace(CLUSTER, container="x", container_mounts=["/a,/b"])))
    monkeypatch.setattr(slurmctl, "srun_has_option", lambda option: False)
    check_container(JobConfig(cluster=replace(CLUSTER, container="x")))  # the form is the config's; srun is the launcher's to ask
    assert (
        launchers()["slurm"]
        .refusal(JobConfig(cluster=replace(CLUSTER, container="x")))
        .startswith("cluster.container=x: this cluster's srun has no --container-image (the pyxis plugin is not installed)")
    )
    monkeypatch.setattr(validate.shutil, "which", lambda tool: None)
    with pytest.raises(UserError, match=r"^cluster.container=x.sif: apptainer not found on PATH"):
        check_container(JobConfig(cluster=replace(CLUSTER, container="x.sif", container_runtime="apptainer")))
    check_container(JobConfig(cluster=replace(CLUSTER, container="x"), dry_run=True))  # a dry run shows the script
