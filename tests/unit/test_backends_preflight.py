"""Backends that cannot start are refused before any rank starts; the rendezvous is derived."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from collectives import init_collectives
from collectives.base import CollectivesError
from collectives.config import CommConfig
from hpc.config.schema import ClusterConfig, JobConfig, ResourcesConfig
from hpc.config.validate import check_backend, check_training
from hpc.env import PORT_BASE, PORT_SPAN, RankInfo, rendezvous
from hpc.errors import UserError
from trainers.config import TrainerConfig

SLURM = ClusterConfig(name="sim", launcher="slurm", partition="debug")


def job(backend: str, compression: str = "none", cluster: ClusterConfig = SLURM, gpus: int = 0, sharding: str = "none") -> JobConfig:
    comm = CommConfig(backend=backend, compression=compression, sharding=sharding)
    return JobConfig(cluster=cluster, resources=replace(ResourcesConfig(), gpus_per_task=gpus), comm=comm)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (job("gloo", "topk"), "comm.compression=topk works with comm=mpi only"),
        (job("horovod", "bf16"), "comm.compression=bf16 is not offered by Horovod"),
        (job("nccl"), "comm=nccl needs GPUs: set resources.gpus_per_task=1"),
        (replace(job("gloo"), trainer=replace(TrainerConfig(), sync_batchnorm=True)), "trainer.sync_batchnorm=true needs comm=nccl"),
        (job("mpi", gpus=1), r"comm=mpi trains on the CPU, but the job asks for 1 GPU\(s\) per task: use comm=nccl \(or comm=auto"),
        (job("gloo", gpus=2), "comm=gloo trains on the CPU, but the job asks for 2 GPU"),
        (job("horovod", gpus=1), "comm=horovod trains on the CPU.*comm.cpu_with_gpus=true"),
        (job("mpi", sharding="zero"), "comm.sharding='zero' is not one of none, optimizer, gradients, full"),
        (job("gloo", sharding="optimizer"), r"comm.sharding=optimizer runs on the toolkit's engine: use comm=mpi \(comm=gloo trains replicated"),
        (job("auto", gpus=1, sharding="gradients"), "comm.sharding=gradients runs on the toolkit's engine: use comm=mpi .comm=nccl"),
        (job("mpi", sharding="full"), "comm.sharding=full runs FSDP2 on torch.distributed: use comm=gloo .CPUs. or comm=nccl .GPUs., not comm=mpi"),
        (job("horovod", sharding="full"), "not comm=horovod"),
        (job("mpi", "topk", sharding="gradients"), "comm.sharding=gradients reduce-scatters uncompressed gradients; set comm.compression=none"),
        (replace(job("mpi", sharding="gradients"), trainer=replace(TrainerConfig(), precision="fp16")), "use trainer.precision=bf16"),
        (replace(job("mpi", sharding="optimizer"), trainer=replace(TrainerConfig(), channels_last=True)), "set trainer.channels_last=false"),
    ],
)
def test_backend_misconfigurations_are_refused_naming_the_fix(config, message):
    with pytest.raises(UserError, match=message):
        check_training(config)  # the comm section's own check (a name off the list), then the backend against the job


NO_GPU = "comm=nccl needs GPUs and torch sees none on this machine; use comm=gloo or comm=mpi"


def test_nccl_run_locally_follows_what_torch_sees(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append("cuda") or False)
    with pytest.raises(UserError, match=NO_GPU):
        check_backend(job("nccl", cluster=ClusterConfig()))
    assert asked == ["cuda"]  # torch's own answer decides, not a config value
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check_backend(job("nccl", cluster=ClusterConfig())) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_backend(job("nccl", gpus=1)) is None  # on Slurm with GPUs requested it is the cluster's to say


def test_nccl_on_this_machine_is_refused_exactly_when_torch_sees_no_gpu():
    """No skip either way: a CPU machine (CI) checks the refusal, a GPU machine the acceptance."""
    local = job("nccl", cluster=ClusterConfig())
    if torch.cuda.is_available():
        assert check_backend(local) is None
        return
    with pytest.raises(UserError, match=NO_GPU):
        check_backend(local)


def test_missing_horovod_names_the_build_script(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "horovod" else real(name, *a))
    with pytest.raises(UserError, match="run scripts/build-horovod.sh"):
        check_backend(job("horovod"))


def test_rendezvous_comes_from_slurm_or_the_launcher():
    env = {"SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "4242"}
    found = rendezvous(env)
    assert found is not None
    address, port = found
    assert address == "gpu07" and PORT_BASE <= port < PORT_BASE + PORT_SPAN
    assert rendezvous({**env, "SLURM_RESTART_COUNT": "1"}) != found  # a requeued run gets a fresh port
    assert rendezvous({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == ("10.0.0.1", 29500)
    assert rendezvous({}) is None


def test_gloo_without_a_rendezvous_is_refused_in_one_line():
    single = RankInfo.from_env({}, hostname="laptop")
    with pytest.raises(CollectivesError, match="no rendezvous: not a Slurm job and MASTER_ADDR/MASTER_PORT are not set"):
        init_collectives(CommConfig(backend="gloo"), single, rendezvous=None)


def test_the_default_backend_follows_the_job_gpus_or_not():
    """comm=auto (the default) is made concrete on the login node and config.yaml names it: NCCL
    with DDP's bucket where the ranks have GPUs, the MPI engine on CPUs; a chosen backend stays."""
    from hpc.config.compose import compose_job

    cpu, gpu = compose_job([]), compose_job(["cluster=simulated", "resources.gpus_per_task=1"])
    assert (cpu.comm.backend, cpu.comm.bucket_mb) == ("mpi", 4.0)
    assert (gpu.comm.backend, gpu.comm.bucket_mb) == ("nccl", 25.0) and check_backend(gpu) is None
    assert compose_job(["cluster=simulated", "resources.gpus_per_task=1", "comm.bucket_mb=8"]).comm.bucket_mb == 8.0
    assert compose_job(["comm=gloo"]).comm.backend == "gloo"


def test_a_cpu_backend_on_a_gpu_job_runs_when_the_user_says_so():
    cpu_on_gpus = replace(job("mpi", gpus=1), comm=CommConfig(backend="mpi", cpu_with_gpus=True))
    assert check_backend(cpu_on_gpus) is None


def test_the_launcher_refuses_a_cpu_backend_for_a_gpu_job_in_one_line():
    """The check on the user's path (issue 46: deleting its call in validate_job left every test
    passing, since they called check_backend alone): launch.py, nothing submitted."""
    import subprocess
    import sys

    from tests.support.runs import ROOT

    done = subprocess.run(
        [sys.executable, "launch.py", "comm=gloo", "resources.gpus_per_task=1", "cluster=simulated", "cluster.gpus_per_node=4", "dry_run=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.strip().splitlines() == [
        "error: comm=gloo trains on the CPU, but the job asks for 1 GPU(s) per task: use comm=nccl (or comm=auto, the default), "
        "or set comm.cpu_with_gpus=true to hold the GPUs and train on cores"
    ]
