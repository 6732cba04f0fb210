import pytest

from hpc.env import RankEnvError, RankInfo


def test_slurm_step_describes_rank_node_and_hosts():
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
        "SLURM_STEP_NODELIST": "gpu[07-08],cpu1",
    }
    info = RankInfo.from_env(env, hostname="ignored")
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (5, 1, 6, 2)
    assert (info.node_rank, info.num_nodes, info.launcher) == (2, 3, "slurm")
    assert info.hosts == ("gpu07", "gpu08", "cpu1") and info.host == "cpu1"


def test_uneven_tasks_per_node_picks_this_nodes_count():
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "4",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "2",
        "SLURM_STEP_NUM_TASKS": "5",
        "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
        "SLURM_STEP_NODELIST": "n[1-3]",
    }
    assert RankInfo.from_env(env).local_world_size == 1


def test_batch_script_without_step_is_not_a_rank():
    # SLURM_PROCID is set in the batch script too; only a job step (srun) makes it a rank.
    info = RankInfo.from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"}, hostname="h")
    assert (info.world_size, info.launcher) == (1, "single")


def test_mpirun_inside_allocation_wins_over_slurm():
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_TASKS": "1",
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    info = RankInfo.from_env(env, hostname="h")
    assert (info.rank, info.world_size, info.local_rank, info.node_rank, info.num_nodes, info.launcher) == (3, 4, 1, 1, 2, "mpirun")


def test_torchrun_variables():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}
    info = RankInfo.from_env(env, hostname="h")
    assert (info.rank, info.node_rank, info.num_nodes, info.launcher) == (3, 1, 2, "torchrun")


def test_pmix_and_single_process():
    info = RankInfo.from_env({"PMIX_RANK": "1", "PMIX_SIZE": "2"}, hostname="h")
    assert (info.rank, info.world_size, info.launcher) == (1, 2, "pmix")
    single = RankInfo.from_env({}, hostname="laptop")
    assert (single.rank, single.world_size, single.hosts, single.is_main) == (0, 1, ("laptop",), True)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, "rank 4 outside world of size 4"),
        ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_RANK='x' is not an integer"),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "3", "SLURM_STEP_NUM_NODES": "2"}, "node_rank 3 outside 2 nodes"),
    ],
)
def test_impossible_layouts_are_refused(env, message):
    with pytest.raises(RankEnvError, match=message):
        RankInfo.from_env(env, hostname="h")
