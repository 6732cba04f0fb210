from dataclasses import replace

import pytest

from hpc.config.schema import ClusterConfig, JobConfig, ResourcesConfig
from hpc.config.validate import check_resources, check_training
from hpc.errors import UserError
from hpc.launching.launch import rank_environment

SIMULATED = ClusterConfig(name="sim", launcher="slurm", cpus_per_node=4, gpus_per_node=0, max_nodes=4)


def job(cluster=SIMULATED, **resources):
    return JobConfig(cluster=cluster, resources=replace(ResourcesConfig(), **resources))


def test_a_request_that_fits_passes():
    assert check_resources(job(nodes=4, tasks_per_node=2, cpus_per_task=2)) is None  # no UserError


@pytest.mark.parametrize(
    "resources, message",
    [
        (dict(nodes=0), "resources.nodes=0 must be >= 1"),
        (dict(tasks_per_node=0), "resources.tasks_per_node=0 must be >= 1"),
        (dict(cpus_per_task=0), "resources.cpus_per_task=0"),
        (dict(nodes=5), "more than the 4 nodes"),
        (dict(tasks_per_node=5), "5 tasks x 1 CPUs per node = 5 > the 4 CPUs"),
        (dict(tasks_per_node=2, cpus_per_task=3), "= 6 > the 4 CPUs"),
        (dict(gpus_per_task=1), "GPUs per node = 2 > the 0 GPUs"),
        (dict(time_min=0), "time limit"),
    ],
)
def test_impossible_requests_are_refused(resources, message):
    with pytest.raises(UserError, match=message):
        check_resources(job(**resources))


def test_local_cluster_is_one_node_but_may_oversubscribe_cores():
    local = ClusterConfig()
    check_resources(job(local, tasks_per_node=64))
    with pytest.raises(UserError, match="this one machine"):
        check_resources(job(local, nodes=2))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda j: replace(j, model=replace(j.model, name="vit")), "model.name='vit' is not one of mlp, cnn"),
        (lambda j: replace(j, comm=replace(j.comm, backend="nccl2")), "comm.backend"),
        (lambda j: replace(j, checkpoint=replace(j.checkpoint, keep=1)), "keep at least 2"),
        (lambda j: replace(j, checkpoint=replace(j.checkpoint, uri="s4://bucket/x")), r"checkpoint.uri=s4://bucket/x: fsspec knows no storage s4://"),
        (lambda j: replace(j, checkpoint=replace(j.checkpoint, uri="s3://")), r"checkpoint.uri=s3://: name a bucket \(and a prefix\)"),
        (lambda j: replace(j, optim=replace(j.optim, lr=0.0)), "optim.lr=0.0 must be a finite number > 0"),
        (lambda j: replace(j, trainer=replace(j.trainer, epochs=0)), "trainer.epochs=0"),
        (lambda j: replace(j, trainer=replace(j.trainer, watchdog_s=0)), "trainer.watchdog_s=0 must be > 0 seconds, or null"),
        (lambda j: replace(j, trainer=replace(j.trainer, watchdog_startup_s=-1)), "trainer.watchdog_startup_s=-1 must be > 0"),
    ],
)
def test_bad_training_settings_are_refused(change, message):
    with pytest.raises(UserError, match=message):
        check_training(change(JobConfig()))


def test_an_object_store_whose_package_is_missing_is_refused_naming_the_extra(monkeypatch):
    import fsspec

    def missing(protocol: str):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(UserError, match=r"checkpoint.uri=s3://b/p: the package for s3:// is not installed \(pip install 'hpc-toolkit\[storage\]'\)"):
        check_training(replace(JobConfig(), checkpoint=replace(JobConfig().checkpoint, uri="s3://b/p")))
    check_training(replace(JobConfig(), checkpoint=replace(JobConfig().checkpoint, uri="/scratch/checkpoints")))  # a directory: no package


def test_rank_environment_adds_cluster_env_and_root_permission(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    env = rank_environment(job(cluster=replace(SIMULATED, env={"FOO": "bar"})))
    assert env["FOO"] == "bar" and "OMP_NUM_THREADS" not in env  # each rank counts the cores it owns
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"  # torch's large tensors on huge pages
    chosen = job(cluster=SIMULATED)
    assert rank_environment(replace(chosen, trainer=replace(chosen.trainer, threads_per_rank=2)))["OMP_NUM_THREADS"] == "2"


def test_huge_pages_are_the_users_to_turn_off(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert rank_environment(job(cluster=replace(SIMULATED, env={"THP_MEM_ALLOC_ENABLE": "0"})))["THP_MEM_ALLOC_ENABLE"] == "0"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # exported where the job is launched: passed on as it is
    assert rank_environment(job())["THP_MEM_ALLOC_ENABLE"] == "0"
