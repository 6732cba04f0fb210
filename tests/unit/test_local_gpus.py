"""GPU machines found without being told (issue 43, part 5): with cluster=local the default job
runs one rank per GPU over NCCL, as `torchrun --nproc-per-node=gpu` does; the GPUs are counted
without torch (CUDA_VISIBLE_DEVICES, a stand-in `nvidia-smi -L` on PATH, /proc/driver/nvidia/gpus);
a choice on the command line, a CPU machine and Slurm keep the job as it was."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import hpc.config.local_gpus as local_gpus
from collectives.config import CommConfig
from hpc.config.compose import compose_job, sweep_points
from hpc.config.local_gpus import built_for_gpus, machine_gpus, nvidia_smi_list, with_local_gpus
from hpc.config.schema import JobConfig
from hpc.fabric.detect import GpuCount, count_gpus, parse_nvidia_smi_list, visible_gpus
from tests.support.docs import marked_blocks
from tests.support.runs import ROOT

H100_LIST = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i}a6c2f3e-8d0b-4b2a-9c1e-5f7d3e2b1a0{i})\n" for i in range(4))
MIG_LIST = "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5d2f)\n  MIG 1g.5gb Device 0: (UUID: MIG-8a1c)\n  MIG 1g.5gb Device 1: (UUID: MIG-8a1d)\n"
NOTE = "found 4 GPUs (nvidia-smi): 4 ranks, one per GPU, comm=nccl (resources.gpus_per_task=0 keeps the CPU job)"


def never() -> str | None:
    raise AssertionError("nvidia-smi was asked although CUDA_VISIBLE_DEVICES says which GPUs there are")


@pytest.mark.parametrize(
    ("value", "count"),
    [("", 0), ("-1", 0), ("0", 1), ("0,1,2,3", 4), (" 2 , 3 ", 2), ("GPU-5d2f,MIG-8a1c", 2), ("0,-1,2", 1), ("NoDevFiles", 0)],
)
def test_cuda_visible_devices_decides_when_it_is_set(value, count):
    assert visible_gpus(value) == count
    assert count_gpus({"CUDA_VISIBLE_DEVICES": value}, never, Path("/nonexistent")) == GpuCount(count, "CUDA_VISIBLE_DEVICES")


def test_nvidia_smi_lists_gpus_and_mig_devices_are_not_counted_apart(tmp_path):
    assert parse_nvidia_smi_list(H100_LIST) == 4
    assert parse_nvidia_smi_list(MIG_LIST) == 1
    (tmp_path / "0000:18:00.0").mkdir()  # /proc is not read once nvidia-smi answered
    assert count_gpus({}, lambda: H100_LIST, tmp_path) == GpuCount(4, "nvidia-smi")


def test_proc_entries_count_where_nvidia_smi_is_missing_or_lists_none(tmp_path):
    proc = tmp_path / "gpus"
    assert count_gpus({}, lambda: None, proc) == GpuCount(0, "")  # no driver: no such directory
    proc.mkdir()
    assert count_gpus({}, lambda: None, proc) == GpuCount(0, "")
    for address in ("0000:18:00.0", "0000:2a:00.0"):
        (proc / address).mkdir()
    assert count_gpus({}, lambda: None, proc) == GpuCount(2, str(proc))
    assert count_gpus({}, lambda: "No devices were found\n", proc) == GpuCount(2, str(proc))


def stand_in(directory: Path, body: str) -> Path:
    """An executable `nvidia-smi` in `directory` running this shell body."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvidia-smi"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return directory


def listing(directory: Path, calls: Path | None = None) -> Path:
    """A stand-in `nvidia-smi` that answers `-L` as a 4 x H100 machine does (and notes each call in `calls`)."""
    note = f'echo "$@" >> {calls}\n' if calls else ""
    return stand_in(directory, f'{note}[ "$1" = "-L" ] || exit 9\nprintf "%s" "{H100_LIST}"')


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """This process as on a machine of our making: no CUDA_VISIBLE_DEVICES, PATH with nothing
    but what a test puts in tmp_path/bin, an empty /proc/driver/nvidia/gpus, a torch built for GPUs."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(local_gpus, "PROC_GPUS", tmp_path / "proc-gpus")
    monkeypatch.setattr(local_gpus, "torch_has_gpus", lambda: True)
    return tmp_path


def test_the_stand_in_nvidia_smi_is_run_and_a_failing_one_falls_back_to_proc(machine):
    assert machine_gpus() == GpuCount(0, "")  # no nvidia-smi, no driver
    listing(machine / "bin")
    assert machine_gpus() == GpuCount(4, "nvidia-smi")
    stand_in(machine / "bin", 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9')
    (machine / "proc-gpus" / "0000:18:00.0").mkdir(parents=True)
    assert machine_gpus() == GpuCount(1, str(machine / "proc-gpus"))


def test_a_hanging_nvidia_smi_is_given_up_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(stand_in(tmp_path, f"exec {shutil.which('sleep')} 30")))
    started = time.monotonic()
    assert nvidia_smi_list(timeout_s=0.5) is None
    assert time.monotonic() - started < 10


def test_a_torch_without_cuda_or_rocm_is_told_from_its_version_file():
    assert built_for_gpus("__version__ = '2.13.0+cu128'\ncuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n")
    assert built_for_gpus("cuda: Optional[str] = None\nhip: Optional[str] = '6.2.41133'\n")
    assert not built_for_gpus("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n")


def cpu_job(*overrides: str) -> JobConfig:
    """The job these overrides compose on a machine without GPUs."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the `machine` fixture's monkeypatch restores it
    try:
        return compose_job(list(overrides))
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]


def test_the_default_job_on_a_gpu_machine_runs_one_rank_per_gpu_over_nccl(machine):
    listing(machine / "bin")
    job = compose_job([])
    assert (job.resources.tasks_per_node, job.resources.gpus_per_task, job.comm.backend) == (4, 1, "nccl")
    assert job.comm.bucket_mb == 25.0  # comm=auto on GPUs: DDP's bucket
    assert (job.cluster.gpus_per_node, job.topology.gpus_per_node) == (4, 4)  # validated against, and each rank binds GPU local_rank
    cpu = cpu_job()
    assert job == replace(
        cpu,
        resources=replace(cpu.resources, tasks_per_node=4, gpus_per_task=1),
        comm=replace(cpu.comm, backend="nccl", bucket_mb=25.0),
        cluster=replace(cpu.cluster, gpus_per_node=4),
        topology=replace(cpu.topology, gpus_per_node=4),
    )  # nothing else changed


@pytest.mark.parametrize(
    "overrides",
    [
        ["resources.gpus_per_task=0"],
        ["comm=mpi"],
        ["comm=gloo"],
        ["resources.tasks_per_node=3"],
        ["++resources.tasks_per_node=2"],
        ["resources=default"],
        ["comm=auto", "resources.gpus_per_task=0"],
    ],
)
def test_a_choice_on_the_command_line_keeps_the_users_job(machine, overrides):
    listing(machine / "bin")
    job = compose_job(overrides)
    assert replace(job, cluster=replace(job.cluster, gpus_per_node=0)) == cpu_job(*overrides)
    assert job.cluster.gpus_per_node == 4  # the machine's GPUs, for validation: a GPU job of the user's may use them


def test_ranks_the_user_gives_gpus_bind_one_gpu_each_without_the_note(machine):
    listing(machine / "bin")
    job = compose_job(["resources.tasks_per_node=2", "resources.gpus_per_task=1"])
    assert (job.resources.tasks_per_node, job.comm.backend, job.topology.gpus_per_node) == (2, "nccl", 4)


def test_a_local_cluster_that_says_how_many_gpus_caps_the_ranks(machine):
    listing(machine / "bin")
    job = compose_job(["cluster.gpus_per_node=2"])
    assert (job.resources.tasks_per_node, job.cluster.gpus_per_node, job.topology.gpus_per_node) == (2, 2, 2)


def test_a_users_script_gets_a_rank_per_gpu_and_sees_every_gpu_as_under_torchrun(machine):
    listing(machine / "bin")
    job = compose_job([f"script={ROOT / 'examples' / 'own_loop' / 'train.py'}"])
    assert (job.resources.tasks_per_node, job.resources.gpus_per_task, job.comm.backend) == (4, 1, "nccl")
    assert job.topology.gpus_per_node == 0  # no binding: the script picks cuda:LOCAL_RANK


def test_without_gpus_or_a_gpu_torch_the_default_job_is_unchanged(machine, monkeypatch):
    stand_in(machine / "bin", "exit 9")  # the driver's tools without a driver
    job = compose_job([])
    assert (job.resources.tasks_per_node, job.resources.gpus_per_task, job.comm.backend) == (2, 0, "mpi")  # the embedded default
    assert (job.cluster.gpus_per_node, job.topology.gpus_per_node) == (0, 0)
    assert job == cpu_job()
    listing(machine / "bin")
    monkeypatch.setattr(local_gpus, "torch_has_gpus", lambda: False)  # the CPU wheels: NCCL could not start
    on_cpu_torch = compose_job([])
    assert replace(on_cpu_torch, cluster=replace(on_cpu_torch.cluster, gpus_per_node=0)) == cpu_job()


def test_on_slurm_nothing_changes_and_nvidia_smi_is_not_asked(machine):
    calls = machine / "calls"
    listing(machine / "bin", calls)
    assert compose_job(["cluster=simulated"]) == cpu_job("cluster=simulated")
    assert not calls.exists()
    points = sweep_points(["optim.lr=0.1,0.2,0.4"])  # a local sweep: every point on the GPUs, counted once
    assert [job.resources.tasks_per_node for _, job in points] == [4, 4, 4]
    assert calls.read_text().splitlines() == ["-L"]


def test_the_line_says_what_was_found_and_how_to_keep_the_cpu_job(machine):
    job = replace(JobConfig(), comm=CommConfig(backend="auto"))  # as composed: the local cluster, 2 CPU ranks, comm=auto
    one = with_local_gpus(job, frozenset(), lambda: GpuCount(1, "CUDA_VISIBLE_DEVICES"))
    assert one[1] == "found 1 GPU (CUDA_VISIBLE_DEVICES): 1 rank, one per GPU, comm=nccl (resources.gpus_per_task=0 keeps the CPU job)"
    assert with_local_gpus(job, frozenset({"resources.gpus_per_task"}), lambda: GpuCount(4, "nvidia-smi"))[1] is None
    assert with_local_gpus(job, frozenset(), lambda: GpuCount(0, "")) == (job, None)


PATCHED_LAUNCH = """
import runpy, sys
import torch
torch.cuda.is_available = lambda: True  # validation asks torch whether comm=nccl can start here
import hpc.config.local_gpus
hpc.config.local_gpus.torch_has_gpus = lambda: True  # a torch built for CUDA (this one is the CPU wheel)
sys.argv = ["launch.py", *sys.argv[1:]]
runpy.run_path("launch.py", run_name="__main__")
"""


def dry_run(tmp_path: Path, path: str, program: list[str], hidden: tuple[str, ...] = ()) -> list[str]:
    """stdout's lines of `python PROGRAM dry_run=true` with this PATH, without the variables `hidden`."""
    env = {key: value for key, value in os.environ.items() if key not in hidden}
    done = subprocess.run(
        [sys.executable, *program, "dry_run=true", f"run_root={tmp_path / 'runs'}"],
        cwd=ROOT,
        env={**env, "PATH": path, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_launchers_first_line_says_what_the_gpus_changed(tmp_path):
    lines = dry_run(tmp_path, f"{listing(tmp_path / 'bin')}:{os.environ['PATH']}", ["-c", PATCHED_LAUNCH], hidden=("CUDA_VISIBLE_DEVICES",))
    assert lines[0].endswith(f"[hpc.launch][INFO] - {NOTE}"), lines[0]
    (shown,) = marked_blocks("docs/running-jobs.md", __file__)
    assert shown.body == f"{NOTE}\n"  # the line the docs show
    assert lines[1] == "# resolved config"
    assert {"  tasks_per_node: 4", "  gpus_per_task: 1", "  backend: nccl"} <= set(lines)
    assert " -n 4 " in lines[-1]  # mpirun starts 4 ranks


def test_launch_without_nvidia_smi_runs_the_cpu_job_and_says_nothing(tmp_path):
    lines = dry_run(tmp_path, f"{stand_in(tmp_path / 'bin', 'exit 9')}:{os.environ['PATH']}", ["launch.py"])
    assert lines[0] == "# resolved config"
    assert {"  tasks_per_node: 2", "  gpus_per_task: 0", "  backend: mpi"} <= set(lines)
    assert " -n 2 " in lines[-1]
