import pytest

from hpc.config.compose import compose_job, register_schemas, schema_keys
from hpc.errors import UserError

register_schemas()


def test_valid_overrides_compose():
    job = compose_job(["optim.lr=0.1", "model=cnn", "resources.nodes=2", "cluster=simulated"])
    assert (job.optim.lr, job.model.name, job.resources.nodes, job.cluster.name) == (0.1, "cnn", 2, "simulated")


def test_unknown_key_names_the_valid_keys():
    with pytest.raises(UserError, match=r"^unknown key 'optim\.lrr'; valid keys in 'optim': ") as err:
        compose_job(["optim.lrr=0.1"])
    message = str(err.value)
    assert "unknown key 'optim.lrr'" in message and "lr, momentum, weight_decay" in message
    assert "\n" not in message


def test_unknown_top_level_key_lists_root_keys():
    with pytest.raises(UserError, match="valid keys in the root config: cluster, resources"):
        compose_job(["dryrun=true"])


def test_unknown_group_option_lists_options():
    with pytest.raises(UserError, match="unknown option model=resnet9000; choose one of: cnn, mlp"):
        compose_job(["model=resnet9000"])


def test_wrong_type_is_one_line():
    with pytest.raises(UserError, match="resources.nodes") as err:
        compose_job(["resources.nodes=two"])
    assert "two" in str(err.value) and "\n" not in str(err.value)


def test_schema_keys_walks_nested_dataclasses():
    assert schema_keys("optim.lr") is None
    parent, names = schema_keys("resources.gpus")
    assert parent == "resources" and "tasks_per_node" in names
