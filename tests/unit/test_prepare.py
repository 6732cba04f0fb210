import pytest

from hpc.config.schema import JobConfig
from hpc.errors import UserError
from hpc.slurm.environment import allocation_shape
from hpc.slurm.prepare import fit_to_allocation, granted_shape


@pytest.mark.parametrize(
    "env, shape",
    [
        ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4"}, (2, 4)),
        ({"SLURM_JOB_NUM_NODES": "3", "SLURM_TASKS_PER_NODE": "2(x3)"}, (3, 2)),
        ({"SLURM_JOB_NUM_NODES": "1", "SLURM_TASKS_PER_NODE": "8"}, (1, 8)),
    ],
)
def test_allocation_shape_from_sbatch_env(env, shape):
    assert allocation_shape(env) == shape


def test_outside_an_allocation_is_a_clear_error():
    assert allocation_shape({}) is None
    with pytest.raises(UserError, match="inside an sbatch allocation"):
        granted_shape({})


def test_uneven_tasks_per_node_are_refused_in_one_line():
    with pytest.raises(UserError, match=r"different task counts per node \(2\(x2\),1\); ask for --ntasks-per-node"):
        granted_shape({"SLURM_JOB_NUM_NODES": "3", "SLURM_TASKS_PER_NODE": "2(x2),1"})


def test_allocation_wins_and_contradictions_are_refused():
    job = fit_to_allocation(JobConfig(), 2, 4, ["resources.nodes=2"])
    assert (job.resources.nodes, job.resources.tasks_per_node) == (2, 4)
    with pytest.raises(UserError, match="resources.tasks_per_node=3 but sbatch granted 4"):
        fit_to_allocation(JobConfig(), 2, 4, ["resources.tasks_per_node=3"])
