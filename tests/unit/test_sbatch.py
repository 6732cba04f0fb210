import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from hpc.config.schema import ClusterConfig, JobConfig, ResourcesConfig
from hpc.errors import UserError
from hpc.rundir import RunDir
from hpc.slurm.batch import render_sbatch, sbatch_parameters

CLUSTER = ClusterConfig(name="sim", launcher="slurm", partition="debug", cpus_per_node=4, max_nodes=4, time_min=20, account="proj1")


def render(tmp_path: Path, env=None, **resources):
    """The script a submission would give sbatch (the dry run's), for a run dir under tmp_path."""
    job = JobConfig(cluster=CLUSTER, resources=replace(ResourcesConfig(), **resources), name="train")
    return render_sbatch(job, env or {}, RunDir(tmp_path / "a b"))


def sbatch_lines(text):
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_resources_become_sbatch_flags(tmp_path):
    lines = sbatch_lines(render(tmp_path, nodes=2, tasks_per_node=3, cpus_per_task=1))
    for flag in ("--nodes=2", "--ntasks-per-node=3", "--cpus-per-task=1", "--partition=debug", "--time=20", "--account=proj1", "--job-name=train"):
        assert f"#SBATCH {flag}" in lines


def test_ranks_start_with_srun_pmix_and_the_run_dir_is_quoted(tmp_path):
    text = render(tmp_path, nodes=2)
    command = next(line for line in text.splitlines() if line.startswith("#   srun "))  # shown; submitit's pickle carries it
    assert "--mpi=pmix" in command and command.endswith(f"-m hpc.rank.main '{tmp_path}/a b'")
    assert f"-m submitit.core._submit '{tmp_path}/a b/slurm/%j'" in text  # submitit's own job runner: the supervisor
    assert "--nodes=" not in command and "#SBATCH --no-kill" not in text  # the step takes the whole allocation
    assert not (tmp_path / "a b").exists()  # the dry run's submission left nothing


def test_spare_nodes_are_allocated_beside_the_step_which_runs_on_the_others(tmp_path):
    job = JobConfig(cluster=CLUSTER, resources=ResourcesConfig(nodes=2, tasks_per_node=3, spare_nodes=1))
    text = render_sbatch(job, {}, RunDir(tmp_path / "x"))
    assert "#SBATCH --nodes=3" in sbatch_lines(text) and "#SBATCH --no-kill" in sbatch_lines(text)
    command = next(line for line in text.splitlines() if line.startswith("#   srun "))
    assert "--nodes=2 --ntasks=6 --ntasks-per-node=3" in command
    assert "export HPCTK_STEP_NODES=2" in text and "export HPCTK_ALLOCATION_RESTARTS=3" in text


def test_env_values_are_passed_literally_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    nasty = f'a\'b "c" $(touch {marker}) `touch {marker}`; touch {marker}\nnext'
    text = render(tmp_path, env={"NASTY": nasty})
    setup = text[text.index("# setup") : text.index("# command")]
    script = setup + 'printf %s "$NASTY"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout == nasty and not marker.exists()


def test_env_names_must_be_shell_identifiers():
    with pytest.raises(UserError, match="not shell variables: A;B"):
        sbatch_parameters(JobConfig(cluster=CLUSTER), {"A;B": "x"})


def test_script_is_valid_bash(tmp_path):
    checked = subprocess.run(["bash", "-n"], input=render(tmp_path, nodes=2), capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr
    broken = subprocess.run(["bash", "-n"], input=render(tmp_path, nodes=2) + "\nif then\n", capture_output=True, text=True)
    assert broken.returncode == 2 and "syntax error" in broken.stderr  # `bash -n` does refuse a bad script


def test_switches_become_an_sbatch_flag_and_are_checked(tmp_path):
    from hpc.config.validate import validate_job

    job = JobConfig(cluster=replace(CLUSTER, switches=2, switches_wait_min=15), resources=replace(ResourcesConfig(), nodes=4), name="train")
    assert "#SBATCH --switches=2@15" in sbatch_lines(render_sbatch(job, {}, RunDir(tmp_path / "x")))
    assert not any("--switches" in line for line in sbatch_lines(render(tmp_path, nodes=4)))
    with pytest.raises(UserError, match="cluster.switches=5 must be between 1 and resources.nodes=4"):
        validate_job(replace(job, cluster=replace(job.cluster, switches=5)))


def test_a_line_break_in_the_run_dir_cannot_end_the_comment_that_shows_the_srun_line(tmp_path):
    job = JobConfig(cluster=CLUSTER, name="train")
    text = render_sbatch(job, {}, RunDir(tmp_path / "a\ntouch pwned"))
    shown = text[text.index("# the ranks' step") : text.index("# command")].strip().splitlines()
    assert len(shown) == 2 and all(line.startswith("#") for line in shown), shown
    assert "a\\ntouch pwned" in shown[1]
