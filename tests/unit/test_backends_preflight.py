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
from hpc.config.validate import check_backend
from hpc.env import PORT_BASE, PORT_SPAN, RankInfo, rendezvous
from hpc.errors import UserError
from trainers.config import TrainerConfig

SLURM = ClusterConfig(name="sim", launcher="slurm", partition="debug")


def job(backend: str, compression: str = "none", cluster: ClusterConfig = SLURM, gpus: int = 0) -> JobConfig:
    return JobConfig(cluster=cluster, resources=replace(ResourcesConfig(), gpus_per_task=gpus), comm=CommConfig(backend=backend, compression=compression))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (job("gloo", "topk"), "comm.compression=topk works with comm=mpi only"),
        (job("horovod", "bf16"), "comm.compression=bf16 is not offered by Horovod"),
        (job("nccl"), "comm=nccl needs GPUs: set resources.gpus_per_task=1"),
        (replace(job("gloo"), trainer=replace(TrainerConfig(), sync_batchnorm=True)), "trainer.sync_batchnorm=true needs comm=nccl"),
    ],
)
def test_backend_misconfigurations_are_refused_naming_the_fix(config, message):
    with pytest.raises(UserError, match=message):
        check_backend(config)


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
