import pytest

from hpc.config import register_schemas
from hpc.errors import UserError
from hpc.overrides import check_overrides, schema_keys

register_schemas()


def test_valid_overrides_compose():
    job = check_overrides(["optim.lr=0.1", "model=cnn", "resources.nodes=2", "cluster=simulated"])
    assert (job.optim.lr, job.model.name, job.resources.nodes, job.cluster.name) == (0.1, "cnn", 2, "simulated")


def test_unknown_key_names_the_valid_keys():
    with pytest.raises(UserError, match=r"^unknown key 'optim\.lrr'; valid keys in 'optim': ") as err:
        check_overrides(["optim.lrr=0.1"])
    message = str(err.value)
    assert "unknown key 'optim.lrr'" in message and "lr, momentum, weight_decay" in message
    assert "\n" not in message


def test_unknown_top_level_key_lists_root_keys():
    with pytest.raises(UserError, match="valid keys in the root config: cluster, resources"):
        check_overrides(["dryrun=true"])


def test_unknown_group_option_lists_options():
    with pytest.raises(UserError, match="unknown option model=resnet9000; choose one of: cnn, mlp"):
        check_overrides(["model=resnet9000"])


def test_wrong_type_is_one_line():
    with pytest.raises(UserError, match="resources.nodes") as err:
        check_overrides(["resources.nodes=two"])
    assert "two" in str(err.value) and "\n" not in str(err.value)


def test_schema_keys_walks_nested_dataclasses():
    assert schema_keys("optim.lr") is None
    parent, names = schema_keys("resources.gpus")
    assert parent == "resources" and "tasks_per_node" in names
