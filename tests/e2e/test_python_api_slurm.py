"""`from hpc import submit` on the simulated Slurm, in the calling process: the docs' example run
as written (submit, wait, result, rank 0's console), a sweep as a list of held jobs cancelled from Python, and a refusal raised in one line."""

from __future__ import annotations

import pytest

from hpc import Job, SubmitError, submit
from tests.support.docs import marked_blocks

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]


def test_the_documented_example_submits_waits_and_reads_the_result(tmp_path, monkeypatch):
    (block,) = marked_blocks("docs/running-jobs.md", __file__)
    monkeypatch.chdir(tmp_path)  # run dirs under runs/ here, as from a notebook's directory
    namespace: dict = {}
    exec(compile(block.body, block.where, "exec"), namespace)
    job = namespace["job"]
    assert isinstance(job, Job) and job.job_id and job.run_dir.parent.parent == tmp_path / "runs"
    assert namespace["state"] == "COMPLETED" and job.state() == "COMPLETED"
    assert job.result()["status"] == "completed" and job.result()["steps"] == 20
    console = job.logs()  # rank 0's console file, submitit's own lines left out
    assert "checkpoint step 20 committed" in console and "submitit " not in console, console[-2000:]
    assert list(job.lines()) == console.split("\n")  # the job ended: the whole console, then the end


def test_a_sweep_is_a_list_of_jobs_each_cancelled_from_python_and_a_refusal_raises_its_line(tmp_path):
    jobs = submit("-m", "cluster=simulated", "resources.tasks_per_node=1", "optim.lr=0.1,0.2", "hold=true", cwd=tmp_path)
    assert isinstance(jobs, list) and [job.run_dir.name for job in jobs] == ["0", "1"]
    array = jobs[0].job_id.split("_")[0]
    assert [job.job_id for job in jobs] == [f"{array}_0", f"{array}_1"]
    assert [job.state() for job in jobs] == ["PENDING", "PENDING"]
    for job in jobs:
        job.cancel()
    assert [job.wait(timeout_s=60, poll_s=0.2) for job in jobs] == ["CANCELLED", "CANCELLED"]
    with pytest.raises(SubmitError, match=r"^unknown key 'optim.lrr'; valid keys in 'optim': name, lr"):
        submit("optim.lrr=0.1", cwd=tmp_path)
