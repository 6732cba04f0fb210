import pytest

from hpc.config import JobConfig
from hpc.errors import UserError
from hpc.prepare import allocation_shape, fit_to_allocation


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
    with pytest.raises(UserError, match="inside an sbatch allocation"):
        allocation_shape({})


def test_allocation_wins_and_contradictions_are_refused():
    job = fit_to_allocation(JobConfig(), 2, 4, ["resources.nodes=2"])
    assert (job.resources.nodes, job.resources.tasks_per_node) == (2, 4)
    with pytest.raises(UserError, match="resources.tasks_per_node=3 but sbatch granted 4"):
        fit_to_allocation(JobConfig(), 2, 4, ["resources.tasks_per_node=3"])
