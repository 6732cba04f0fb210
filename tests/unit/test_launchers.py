"""The launcher seam (hpc.launching.launchers, hpc.config.launchers, hpc.rank.scheduler): every
launcher named once with its traits, the checks asking traits rather than names, and a third,
made-up scheduler taking a sweep and a study's waiting with no change outside its own class."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest

from hpc.config.launchers import launcher_names, traits
from hpc.config.schema import ClusterConfig, JobConfig, ResourcesConfig
from hpc.config.validate import check_dependencies, validate_job
from hpc.env import REQUEST_DIR_VARIABLE
from hpc.errors import UserError
from hpc.launching import launchers as launchers_module
from hpc.launching import sweep, trials
from hpc.launching.launchers import GONE, ForegroundLauncher, QueuedJob, QueuedLauncher, launchers
from hpc.launching.sweep import SweepPoint
from hpc.rank import lifecycle
from hpc.rank.scheduler import NoScheduler, scheduler_of
from hpc.rundir import RunDir
from hpc.schedulers import loaded, plugins
from hpc.slurm import slurmctl
from hpc.slurm.job import SlurmJob
from hpc.slurm.launcher import SlurmLauncher
from tests.plugins import fakeq
from tests.plugins.fakeq import FakeQueue


def test_every_launcher_has_its_traits_and_the_kind_its_traits_say():
    assert list(launchers()) == launcher_names() == ["local", "slurm"]
    for name, launcher in launchers().items():
        assert launcher.traits is traits(name)
        assert isinstance(launcher, QueuedLauncher) == launcher.traits.queued != isinstance(launcher, ForegroundLauncher)


def test_a_job_held_after_an_array_keeps_its_own_dependency_too():
    params = {"additional_parameters": {"dependency": "afterok:7"}, "nodes": 1}
    held = SlurmLauncher().after_any(params, "12")
    assert held["additional_parameters"]["dependency"] == "afterok:7,afterany:12" and held["nodes"] == 1
    assert params["additional_parameters"]["dependency"] == "afterok:7"  # the shared parameters untouched
    assert SlurmLauncher().after_any({"additional_parameters": {}}, "12")["additional_parameters"]["dependency"] == "afterany:12"


def test_slurm_jobs_come_from_scontrol_then_accounting_then_gone(monkeypatch):
    records = {"5": {"JobState": "RUNNING", "Restarts": "2"}, "6_*": {"JobState": "PENDING", "Restarts": "0"}}
    asked: list[list[str]] = []
    monkeypatch.setattr(slurmctl, "job_records", lambda ids: records)
    monkeypatch.setattr(slurmctl, "accounting_states", lambda ids: asked.append(list(ids)) or {"8": "COMPLETED"})
    seen = SlurmLauncher().jobs(["5", "6_3", "8", "9"])
    assert seen == {"5": QueuedJob("RUNNING", 2), "6_3": QueuedJob("PENDING", 0), "8": QueuedJob("COMPLETED"), "9": QueuedJob(GONE)}
    assert asked == [["8", "9"]]  # accounting only for the jobs scontrol no longer shows


def clear_registry() -> None:
    plugins.cache_clear()
    loaded.cache_clear()
    launchers_module._LAUNCHERS.clear()


@pytest.fixture
def fake_queue(monkeypatch, tmp_path) -> FakeQueue:
    """FakeQ installed as a package would be: found through its entry point, named nowhere else."""
    monkeypatch.syspath_prepend(str(fakeq.register(tmp_path / "site")))
    clear_registry()
    queue = launchers()["fakeq"]
    assert isinstance(queue, FakeQueue)
    monkeypatch.setattr(sweep, "freeze_job_code", lambda code, *jobs: Path(code).mkdir(parents=True))
    yield queue
    monkeypatch.undo()
    clear_registry()


def on_fake_queue(num: int, nodes: int = 1, max_parallel: int | None = None) -> SweepPoint:
    job = JobConfig()
    job = replace(job, cluster=ClusterConfig(name="fq", launcher="fakeq"), resources=ResourcesConfig(nodes=nodes))
    job = replace(job, sweep=replace(job.sweep, max_parallel=max_parallel))
    return SweepPoint(num, (f"optim.lr=0.{num}",), job)


def test_a_new_scheduler_takes_a_sweep_as_arrays_split_to_its_size_and_chained_under_a_throttle(fake_queue, tmp_path):
    points = [on_fake_queue(0, max_parallel=1), on_fake_queue(1, max_parallel=1), on_fake_queue(2, max_parallel=1), on_fake_queue(3, nodes=2)]
    lines: list[str] = []
    assert sweep.launch_sweep(points, tmp_path, lines.append) == 0
    assert [(names, limit) for _, names, limit in fake_queue.arrays] == [(["0", "1"], 1), (["2"], 1), (["3"], None)]
    assert [params["after"] for params, _, _ in fake_queue.arrays] == [[], ["q0"], []]  # the throttle holds across the split
    record = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["job_id"] for p in record["points"]] == ["q0.0", "q0.1", "q1.0", "q2.0"]
    assert RunDir(tmp_path / "3").read_json(RunDir(tmp_path / "3").job)["launcher"] == "fakeq"
    assert "submitted job array q0: 2 tasks (points #0, #1), at most 1 at once" in lines


def test_a_new_scheduler_answers_a_studys_waiting_for_its_trials(fake_queue, tmp_path):
    for num in (0, 1):
        (tmp_path / str(num)).mkdir()
    RunDir(tmp_path / "0").write_json(RunDir(tmp_path / "0").result, {"status": "completed", "val_metrics": {"accuracy": 0.5}})
    fake_queue.states = {"q0.0": "DONE", "q0.1": "BROKEN"}
    lines: list[str] = []
    points = [on_fake_queue(0), on_fake_queue(1)]
    outcomes = trials.wait_for_jobs(fake_queue, points, {0: "q0.0", 1: "q0.1"}, tmp_path, "val_accuracy", lines.append, poll_s=0)
    assert outcomes[0] == trials.Outcome(0, 0.5)
    assert outcomes[1].value is None and "job q0.1 ended BROKEN without a result" in str(outcomes[1].error)


def test_the_login_checks_ask_a_launchers_traits_not_its_name(fake_queue, monkeypatch):
    """A queued launcher other than Slurm may take more than one node and wait for other jobs;
    one without a queue (this machine's) may do neither."""
    queued = on_fake_queue(0, nodes=3).job
    monkeypatch.setattr("hpc.config.validate.check_node_fit", lambda job: None)
    validate_job(replace(queued, after="q12"))  # refused for nothing a queue offers
    local = replace(queued, cluster=ClusterConfig(name="mine", launcher="local"))
    with pytest.raises(UserError, match=r"resources.nodes=3: cluster=local runs on this one machine"):
        validate_job(local)
    with pytest.raises(UserError, match=r"after= holds a job until others end: it needs a Slurm cluster \(cluster=mine runs at once, here\)"):
        check_dependencies(replace(local, resources=ResourcesConfig(nodes=1), after="12"))


def test_ranks_ask_the_scheduler_of_their_environment(tmp_path, monkeypatch):
    assert isinstance(scheduler_of({}), NoScheduler) and isinstance(scheduler_of({"SLURM_JOB_ID": "4"}), SlurmJob)
    plan = scheduler_of({}).plan_after_stop(datetime.now(), 30)
    assert (plan.requeue_id, plan.exit_code) == (None, lifecycle.EXIT_RESUMABLE) and "to resume" in plan.what
    quiet = NoScheduler()
    told = (
        quiet.job_id(),
        quiet.can_requeue(),
        quiet.requeued_by_batch_script(),
        quiet.mark_finished(),
        quiet.request_requeue("4", "x"),
        quiet.forbid_requeue(),
    )
    assert told == (None, False, False, None, None, None) and quiet.mark_error("x") is None and quiet.note_run_dir(tmp_path) is None
    assert quiet.requeue("4") == "job 4: no scheduler runs these ranks"
    env = {"SLURM_JOB_ID": "4", "SLURM_RESTART_COUNT": "1", REQUEST_DIR_VARIABLE: str(tmp_path)}
    job = scheduler_of(env)
    assert job.job_id() == "4" and job.requeued_by_batch_script() == slurmctl.available("scontrol")
    assert job.request_requeue("4", "stopped by SIGUSR1") == tmp_path / "4.restart-1"
    assert job.mark_finished() == tmp_path / "4.finished"
    assert job.note_run_dir(tmp_path / "run") == tmp_path / "4.run-dir" and (tmp_path / "4.run-dir").read_text() == f"{tmp_path / 'run'}\n"
    assert job.mark_error("rank 1: ValueError") == tmp_path / "4.error-1"
    requeued: list[str] = []
    monkeypatch.setattr(slurmctl, "available", lambda tool="scontrol": False)
    plan = job.plan_after_stop(datetime.now(), 30)
    assert (plan.requeue_id, plan.exit_code, job.can_requeue()) == (None, lifecycle.EXIT_RESUMABLE, False) and plan.what.startswith("scontrol not found: job 4")
    monkeypatch.setattr(slurmctl, "available", lambda tool="scontrol": True)
    monkeypatch.setattr(slurmctl, "requeue", lambda job_id, restarts_before: requeued.append(f"{job_id} after {restarts_before}") or "refused")
    assert job.can_requeue() and job.requeue("4") == "refused" and requeued == ["4 after 1"]  # this start's count: a late success is told apart


def test_a_jobs_launcher_is_the_one_its_job_json_names(tmp_path):
    from hpc.api import Job
    from hpc.launching.launchers import queued_launcher

    with pytest.raises(ValueError, match="launcher local runs jobs in the foreground; it queues none"):
        queued_launcher("local")
    assert queued_launcher("slurm") is launchers()["slurm"]
    run = RunDir(tmp_path)
    assert isinstance(Job(tmp_path, "5").launcher(), SlurmLauncher)  # a run dir from before job.json named one
    run.write_json(run.job, {"job_id": "5", "launcher": "slurm"})
    assert Job(tmp_path, "5").launcher() is launchers()["slurm"]


def test_each_launchers_dry_run_is_what_it_would_run(tmp_path):
    """The dry run's text comes from the launcher: mpirun's command line here, and the very
    script submitit would give sbatch (an sbatch stub that accepts it runs nothing)."""
    from hpc.config.compose import compose_job
    from hpc.launching.launch import rank_environment

    run_dir = RunDir(tmp_path / "run")
    local = compose_job([])
    shown = launchers()["local"].dry_run(local, rank_environment(local), run_dir)
    assert shown.startswith("# command (cluster=local runs mpirun, no sbatch)\n") and "hpc.rank.main" in shown and str(run_dir.path) in shown
    slurm = compose_job(["cluster=simulated", "resources.nodes=2"])
    launcher = launchers()["slurm"]
    assert isinstance(launcher, QueuedLauncher)
    script = launcher.dry_run(slurm, rank_environment(slurm), run_dir)
    assert script.startswith("# sbatch script\n#!/bin/bash") and "#SBATCH --nodes=2" in script
    params = launcher.array_parameters(slurm, rank_environment(slurm), tmp_path / "code")
    array = launcher.render_array(params, tmp_path / "slurm", [RunDir(tmp_path / str(n)) for n in range(3)], 2)
    assert "#SBATCH --array=0-2%2" in array and "#SBATCH --nodes=2" in array


@pytest.mark.parametrize(("state", "result", "code"), [("DONE", True, 0), ("BROKEN", True, 1), ("DONE", False, 1)])
def test_wait_true_follows_a_job_to_its_end_in_its_schedulers_own_words(fake_queue, tmp_path, capsys, monkeypatch, state, result, code):
    """launch.py's wait=true exits 0 only when the scheduler says the job succeeded and the ranks
    wrote their result: no Slurm word in between."""
    from hpc.launching import launch

    monkeypatch.setattr(launch, "freeze_job_code", lambda code, job: code)
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    if result:
        run_dir.write_json(run_dir.result, {"status": "completed"})
    fake_queue.states["q0.0"] = state
    job = replace(on_fake_queue(0).job, wait=True)
    assert launch.submit_and_tell(fake_queue, job, {}, run_dir) == code
    assert json.loads(run_dir.job.read_text())["launcher"] == "fakeq" and fake_queue.submitted == run_dir.path
    assert f"job q0.0 ended: {state}" in capsys.readouterr().out


def test_hpc_stop_the_api_and_after_reach_a_third_scheduler_through_its_launcher(fake_queue, tmp_path, monkeypatch):
    """hpc.stop, the Python API's Job, after= and the checks of the scheduler's own settings ask
    the launcher job.json (or the config) names: a made-up scheduler answers them all with nothing
    but its own class (no Slurm tool is asked)."""
    from hpc.api import Job
    from hpc.launching import launch
    from hpc.tools import stop
    from hpc.tools.status import statuses, statuses_of

    monkeypatch.setattr(slurmctl, "job_records", lambda ids: pytest.fail("Slurm asked of a fakeq job"))
    monkeypatch.setattr(stop.shutil, "which", lambda tool: f"/bin/{tool}" if tool == "true" else None)  # FakeQ's tool only
    monkeypatch.setattr(launch.shutil, "which", stop.shutil.which)
    signalled: list[tuple[str, str]] = []
    monkeypatch.setattr(fake_queue, "signal", lambda job_id, name: signalled.append((job_id, name)))
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.config.write_text("name: train\ncluster:\n  name: fq\n  signal: USR2\n")
    run.write_json(run.job, {"job_id": "q0.1", "launcher": "fakeq"})
    fake_queue.states["q0.1"] = "QUEUED"
    with pytest.raises(UserError, match=r"^job q0.1 is not running \(QUEUED\): no rank to stop \(FakeQ's own cancel removes it\)$"):
        stop.stop_run(run.path)
    fake_queue.states["q0.1"] = "GOING"
    line = stop.stop_run(run.path)
    assert signalled == [("q0.1", "USR2")] and line.startswith("sent SIGUSR2 to every rank of job q0.1 (FakeQ: signal USR2 to job q0.1)")
    assert Job(run.path, "q0.1").launcher() is fake_queue and Job(run.path, "q0.1").state() == "GOING"
    fake_queue.states["q0.1"] = "QUEUED"
    (listed,) = statuses(run.path)  # hpc.status: the state in FakeQ's words, and no rate while it waits
    assert (listed.job_id, listed.state, listed.rate) == ("q0.1", "QUEUED", "-")
    assert "q0.1" in statuses_of([run])[0].line(8) and Job(run.path, "q0.1").ended() is False
    fake_queue.states["q0.1"] = "DONE"
    assert Job(run.path, "q0.1").wait(timeout_s=5, poll_s=0) == "DONE"
    fake_queue.states["q0.2"] = "BROKEN"
    waiting = replace(JobConfig(), cluster=ClusterConfig(name="fq", launcher="fakeq"))
    launch.check_waits(replace(waiting, after="q0.1", after_any="q0.2"))  # running, and broken but waited on in any state
    with pytest.raises(UserError, match=r"^after=q0.2: job q0.2 ended BROKEN, so this job would never start"):
        launch.check_waits(replace(waiting, after="q0.2"))
    with pytest.raises(UserError, match=r"^after_any=q9: FakeQ knows no job q9"):
        launch.check_waits(replace(waiting, after_any="q9"))
    with pytest.raises(UserError, match=r"^after='12': name FakeQ job ids, e.g. after=q1 or after=\[q1,q2\] \(an array's task: q1.0\)$"):
        check_dependencies(replace(waiting, after="12"))  # its own form of ids, on the login node's first check
    with pytest.raises(UserError, match=r"^cluster.sbatch: FakeQ takes no sbatch options \(mail-typo\)$"):  # its own checks, not Slurm's
        launch.check_for_scheduler(replace(waiting, cluster=replace(waiting.cluster, sbatch={"mail-typo": "END"})))
    launch.check_for_scheduler(waiting)
    run.write_json(run.job, {"job_id": "q0.1", "launcher": "pbs"})
    with pytest.raises(UserError, match=r"^job.json names launcher 'pbs', which this toolkit does not know \(known: local, slurm, fakeq\)$"):
        stop.stop_run(run.path)


RANK_SIDE = """
import json, os
from datetime import datetime
from pathlib import Path
from hpc.env import RankInfo, cpus_per_task, job_id, job_hosts, rendezvous, restart_count, task_place
from hpc.rank.scheduler import scheduler_of
info = RankInfo.from_env(os.environ)
job = scheduler_of(os.environ)
plan = job.plan_after_stop(datetime.now(), 30)
print(json.dumps({
    "info": [info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank, info.num_nodes, list(info.hosts), info.launcher],
    "job": [job_id(os.environ), restart_count(os.environ), cpus_per_task(os.environ), list(job_hosts(os.environ)), list(task_place(os.environ))],
    "rendezvous": rendezvous(os.environ),
    "scheduler": type(job).__name__, "plan": [plan.what, plan.requeue_id, plan.exit_code],
    "requeued": job.requeue(plan.requeue_id), "resume": job.resume_command(Path("/runs/a b")),
}))
"""


def test_a_third_schedulers_ranks_know_their_place_rendezvous_and_requeue_through_its_plugin_alone(tmp_path):
    """A rank of a FakeQ job, in a fresh interpreter that finds FakeQ only through its entry point:
    where it sits, its job, its rendezvous, and what a stop does, all from FakeQ's plugin."""
    import os
    import subprocess
    import sys

    site = fakeq.register(tmp_path / "site")
    requeues = tmp_path / "requeues"
    launchers_own = ("SLURM_", "OMPI_", "PMIX_", "FAKEQ_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(launchers_own)}
    root = Path(__file__).resolve().parents[2]
    fake_job = {"FAKEQ_JOB": "q42", "FAKEQ_RANK": "3", "FAKEQ_SIZE": "4", "FAKEQ_PER_NODE": "2", "FAKEQ_NODES": "fa,fb"}
    fake_job |= {"FAKEQ_RESTARTS": "2", "FAKEQ_CPUS": "3"}
    env = {**base, **fake_job, "FAKEQ_REQUEUES": str(requeues), "PYTHONPATH": f"{site}{os.pathsep}{root}"}
    done = subprocess.run([sys.executable, "-c", RANK_SIDE], env=env, capture_output=True, text=True, check=True, timeout=120)
    seen = json.loads(done.stdout)
    assert seen["info"] == [3, 1, 4, 2, 1, 2, ["fa", "fb"], "fakeq"]
    assert seen["job"] == ["q42", 2, 3, ["fa", "fb"], ["3", "fb"]]
    assert seen["rendezvous"] == ["fa", 20042] and seen["scheduler"] == "FakeQJob"
    assert seen["plan"] == ["FakeQ requeues job q42", "q42", 0] and seen["requeued"] is None and requeues.read_text() == "requeue q42\n"
    assert seen["resume"] == "fakeq resubmit '/runs/a b'"
    # without its package installed the same variables are no scheduler's: one process, no job
    alone = subprocess.run([sys.executable, "-c", RANK_SIDE], env={**env, "PYTHONPATH": str(root)}, capture_output=True, text=True, check=True, timeout=120)
    seen = json.loads(alone.stdout)
    assert seen["info"][2] == 1 and seen["info"][7] == "single" and seen["job"][0] is None and seen["scheduler"] == "NoScheduler"


def test_a_broken_or_clashing_plugin_is_refused_in_one_line(tmp_path, monkeypatch):
    from hpc.config.schema import ClusterConfig

    site = tmp_path / "site"
    meta = fakeq.register(site) / "fakeq_plugin-1.0.dist-info" / "entry_points.txt"
    monkeypatch.syspath_prepend(str(site))
    try:
        meta.write_text("[hpc.schedulers]\npbs = no_such_module:PLUGIN\n")
        clear_registry()
        broken = r"^scheduler plugin entry point pbs = no_such_module:PLUGIN cannot be loaded \(ModuleNotFoundError: No module named 'no_such_module'\)$"
        with pytest.raises(UserError, match=broken):
            ClusterConfig(name="x", launcher="pbs").check()
        meta.write_text("[hpc.schedulers]\nslurm2 = hpc.schedulers:BUILT_IN\n")
        clear_registry()
        with pytest.raises(UserError, match=r"^scheduler plugin entry point slurm2 = hpc.schedulers:BUILT_IN is a tuple, not a hpc.schedulers.Sched"):
            plugins()
        meta.write_text("[hpc.schedulers]\nmine = tests.plugins.fakeq:CLASH\n")
        clear_registry()
        with pytest.raises(UserError, match=r"^scheduler plugin entry point mine = tests.plugins.fakeq:CLASH takes the name 'slurm', which is taken$"):
            plugins()
    finally:
        monkeypatch.undo()
        clear_registry()
    assert list(plugins()) == ["slurm"]
