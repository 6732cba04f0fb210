"""Property-based fuzzing of what users type: values that land in sbatch scripts pass through
literally (or are refused in one line), and no override or resource number ever ends in a
traceback instead of a one-line UserError."""

from __future__ import annotations

import shlex
import subprocess
import unicodedata
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc.config.compose import compose_job
from hpc.config.schema import ClusterConfig, JobConfig, ResourcesConfig
from hpc.config.validate import check_resources, check_script_values, validate_job
from hpc.errors import UserError
from hpc.rundir import RunDir
from hpc.slurm.batch import render_sbatch, setup_lines

CLUSTER = ClusterConfig(name="sim", launcher="slurm", partition="debug", cpus_per_node=4, max_nodes=4, time_min=20)
SHELL_SPECIALS = list("'\"$`;|&<>()[]{}*?!#~\\ \n\t\r") + ["$(id)", "`id`", "${HOME}", "\x00", "\x7f", "é", "☃"]
nasty_text = st.lists(st.one_of(st.sampled_from(SHELL_SPECIALS), st.text(min_size=1, max_size=4)), min_size=1, max_size=12).map("".join)
SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def directive_values(script: str) -> dict[str, str]:
    values = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = shlex.split(line[len("#SBATCH ") :])[0].partition("=")
            values[key.removeprefix("--")] = value
    return values


def baseline_lines(root: Path) -> int:
    baseline = JobConfig(cluster=replace(CLUSTER, account="a", constraint="c", sbatch={"comment": "c"}), name="train")
    return len(render_sbatch(baseline, {}, RunDir(root / "x")).splitlines())


@SLOW
@given(name=nasty_text, partition=nasty_text, account=nasty_text, constraint=nasty_text, comment=nasty_text)
def test_sbatch_directive_values_are_literal_or_refused(tmp_path_factory, name, partition, account, constraint, comment):
    """cluster.sbatch's values too (any sbatch option: `comment` here)."""
    cluster = replace(CLUSTER, partition=partition, account=account, constraint=constraint, sbatch={"comment": comment})
    job = JobConfig(cluster=cluster, name=name)
    try:
        check_script_values(job)
    except UserError as err:
        assert "\n" not in str(err)
        controls = [c for c in name + partition + account + constraint + comment if unicodedata.category(c) in ("Cc", "Zl", "Zp")]
        assert controls or "/" in name or not name.strip()
        return
    root = tmp_path_factory.mktemp("sbatch")
    script = render_sbatch(job, {}, RunDir(root / "x"))
    assert len(script.splitlines()) == baseline_lines(root)  # no line was added: nothing can run
    values = directive_values(script)
    assert (values["job-name"], values["partition"], values["account"], values["constraint"]) == (name, partition, account, constraint)
    assert values["comment"] == comment
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@SLOW
@given(value=nasty_text.filter(lambda v: "\x00" not in v))
def test_env_values_reach_the_shell_literally(tmp_path_factory, value):
    marker = tmp_path_factory.mktemp("m") / "pwned"
    payload = f"{value}$(touch {marker})`touch {marker}`;touch {marker}"
    script = "\n".join(setup_lines({"NASTY": payload})) + '\nprintf %s "$NASTY"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True)  # bytes: keep \r as it is
    assert out.stdout == payload.encode() and not marker.exists()


KEYS = [
    "optim.lr",
    "resources.nodes",
    "resources.tasks_per_node",
    "trainer.epochs",
    "data.batch_size",
    "name",
    "model",
    "comm",
    "cluster",
    "trainer.precision",
    "checkpoint.keep",
    "sweep.max_parallel",
    "run_access",
    "optim.lrr",
    "nope",
    "model.hidden_sizes",
]
override_value = st.one_of(
    nasty_text,
    st.integers(-(10**20), 10**20).map(str),
    st.floats(allow_nan=True).map(str),
    st.sampled_from(["null", "[1,2]", "{a: 1}", "true", "mlp", "simulated", "''", "${oops}"]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides=st.lists(st.tuples(st.sampled_from(KEYS), override_value).map(lambda kv: f"{kv[0]}={kv[1]}"), min_size=1, max_size=3))
def test_any_override_either_composes_and_validates_or_fails_in_one_line(overrides):
    try:
        job = compose_job(overrides)
        validate_job(job)
    except UserError as err:
        assert str(err) and "\n" not in str(err) and "Traceback" not in str(err)


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.integers(-5, 10**12),
    tasks=st.integers(-5, 10**12),
    cpus=st.integers(-5, 10**12),
    gpus=st.integers(-5, 10**6),
    time_min=st.one_of(st.none(), st.integers(-5, 10**9)),
    max_parallel=st.one_of(st.none(), st.integers(-5, 10**6)),
)
def test_resource_numbers_are_accepted_or_refused_in_one_line(nodes, tasks, cpus, gpus, time_min, max_parallel):
    job = JobConfig(cluster=CLUSTER, resources=ResourcesConfig(nodes=nodes, tasks_per_node=tasks, cpus_per_task=cpus, gpus_per_task=gpus, time_min=time_min))
    job.sweep.max_parallel = max_parallel
    try:
        check_resources(job)
    except UserError as err:
        assert "\n" not in str(err)
        return
    assert 1 <= nodes <= 4 and tasks * cpus <= 4 and gpus >= 0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "must be non-empty and contain no '/'"),
        ("  ", "must be non-empty"),
        ("a/b", "contain no '/'"),
        ("a\nb", "contains a control character"),
        ("tab\there", "contains a control character"),
    ],
)
def test_bad_job_names_are_refused(name, message):
    with pytest.raises(UserError, match=message):
        check_script_values(JobConfig(cluster=CLUSTER, name=name))
