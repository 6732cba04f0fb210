"""cluster=local on a machine with GPUs: the default job runs one rank per GPU over NCCL, as
`torchrun --nproc-per-node=gpu` does; on a CPU machine, and on Slurm, the job is unchanged.

The GPUs are counted on the login path without torch (hpc.fabric.detect.count_gpus:
CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`, else /proc/driver/nvidia/gpus), and only where
it can change the job (cluster.launcher=local). "The default job" is the one whose resources
and backend nobody chose: the command line names none of `resources=`,
`resources.tasks_per_node`, `resources.gpus_per_task`, the composed values are still the
resources group's defaults (a preset that sets others is someone's choice too), and the backend
is `auto` (or `nccl`). `resources.gpus_per_task=0`, any other resources, or a CPU backend
(`comm=mpi`, `gloo`, `horovod`) keeps the CPU job. A torch built without CUDA (the CPU wheels)
keeps it too: NCCL could not start.

Whether a job's ranks use GPUs or not, the local cluster's `gpus_per_node` (0 in its preset:
not known) becomes the count found, so validation checks GPU requests against this machine.
A built-in task's GPU ranks each get one GPU of their own: a topology without GPUs (the default
`cpu`) gets the count, and the binding sets each rank's CUDA_VISIBLE_DEVICES. A user's script
sees every GPU, as under torchrun, and picks its own by LOCAL_RANK.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from collectives.backends import BACKEND_TABLE
from hpc.config.launchers import traits
from hpc.config.schema import JobConfig, ResourcesConfig, typed_job, with_backend
from hpc.fabric.detect import PROC_GPUS, GpuCount, count_gpus

NVIDIA_SMI_TIMEOUT_S = 5.0  # `nvidia-smi -L` answers in well under a second where a driver is loaded
GPU_BACKENDS = ("auto", *(name for name, backend in BACKEND_TABLE.items() if backend.trains_on == "gpu"))  # auto becomes nccl
CHOSEN_KEYS = frozenset({"resources", "resources.tasks_per_node", "resources.gpus_per_task"})  # naming one is a choice


def local_job(cfg: Any, overrides: Iterable[str], found: Callable[[], GpuCount] | None = None) -> tuple[JobConfig, str | None]:
    """The composed config `cfg` (the job's part) as the typed job that runs here, with the line
    that says what this machine's GPUs changed (None: nothing). `overrides`: the ones composed;
    `found`: counts the GPUs (by default this machine's, asked where it can matter)."""
    job, note = with_local_gpus(typed_job(cfg), named_keys(overrides), found or machine_gpus)
    return with_backend(job), note


def nvidia_smi_list(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> str | None:
    """`nvidia-smi -L`'s output; None where it is missing, fails or hangs."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=timeout_s, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def machine_gpus() -> GpuCount:
    """This machine's GPUs, as this process's environment shows them."""
    return count_gpus(os.environ, nvidia_smi_list, PROC_GPUS)


def torch_has_gpus() -> bool:
    """Whether the installed torch was built for GPUs, read from its version.py without importing
    it (seconds on a login node)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        return built_for_gpus((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except OSError:
        return False


def built_for_gpus(version_py: str) -> bool:
    """torch/version.py names a CUDA or ROCm version (`cuda: Optional[str] = '12.8'`); None on
    the CPU wheels."""
    return re.search(r"^(cuda|hip)\b[^=\n]*=\s*['\"]", version_py, flags=re.MULTILINE) is not None


def override_key(override: str) -> str:
    """The key (or config group) an override names: `++resources.nodes=2` -> resources.nodes."""
    return override.split("=", 1)[0].lstrip("+~")


def named_keys(overrides: Iterable[str]) -> frozenset[str]:
    """The keys (and config groups) a list of overrides names."""
    return frozenset(map(override_key, overrides))


def chooses_resources(job: JobConfig, named: frozenset[str]) -> bool:
    """Whether someone chose this job's ranks or backend (see the module's docstring)."""
    default = ResourcesConfig()
    untouched = job.resources.tasks_per_node == default.tasks_per_node and job.resources.gpus_per_task == default.gpus_per_task
    return bool(named & CHOSEN_KEYS) or not untouched or job.comm.backend not in GPU_BACKENDS


def with_local_gpus(job: JobConfig, named: frozenset[str], found: Callable[[], GpuCount] = machine_gpus) -> tuple[JobConfig, str | None]:
    """The job on this machine's GPUs, and the line that says so where they changed its ranks
    (None where they did not). `job`: as composed, its backend not resolved yet (`auto`);
    `named`: the keys its overrides name; `found`: counts the GPUs (called for local jobs only).
    Pure but for `found`."""
    try:
        chosen = traits(job.cluster.launcher)
    except KeyError:  # an unknown one: refused by hpc.config.validate
        return job, None
    if chosen.asks_for_gpus:
        return job, None  # Slurm: the job asks for what it uses
    gpus = found()
    if not gpus.count:
        return job, None
    told = job.cluster.gpus_per_node  # a local cluster preset that says how many GPUs to use
    usable = min(told, gpus.count) if told else gpus.count
    job = replace(job, cluster=job.cluster if told else replace(job.cluster, gpus_per_node=gpus.count))
    note = None
    if not chooses_resources(job, named) and torch_has_gpus():
        job = replace(job, resources=replace(job.resources, tasks_per_node=usable, gpus_per_task=1))
        plural = "s" if gpus.count > 1 else ""
        ranks = f"{usable} rank{'s' if usable > 1 else ''}"
        note = f"found {gpus.count} GPU{plural} ({gpus.source}): {ranks}, one per GPU, comm=nccl (resources.gpus_per_task=0 keeps the CPU job)"
    return with_gpu_binding(job, usable), note


def with_gpu_binding(job: JobConfig, gpus: int) -> JobConfig:
    """A built-in task's ranks of one GPU each, on a topology that lists no GPUs: the topology
    gets this machine's, so that local rank i binds GPU i (hpc.rank.binding)."""
    res, topo = job.resources, job.topology
    if job.script is not None or res.gpus_per_task != 1 or topo.gpus_per_node or res.tasks_per_node > gpus:
        return job
    return replace(job, topology=replace(topo, gpus_per_node=gpus))
