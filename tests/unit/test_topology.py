from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from hpc.config.compose import CONF_DIR
from hpc.errors import UserError
from hpc.fabric.topology import TopologyConfig, map_ranks, order_for_ring, parse_cpu_list, parse_topology_conf, ring_hops


def preset(name: str) -> TopologyConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TopologyConfig), OmegaConf.load(CONF_DIR / "topology" / f"{name}.yaml")))


def test_cpu_lists_parse_like_sysfs():
    assert parse_cpu_list("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    with pytest.raises(UserError, match="malformed CPU list"):
        parse_cpu_list("0-x")


def test_dgx_h100_binds_each_local_rank_to_its_rail_and_numa_half():
    bindings = map_ranks(preset("dgx_h100"), ["n1", "n2"], 8)
    assert [b.rank for b in bindings] == list(range(16))
    for b in bindings:
        assert (b.gpu, b.rail, b.nic) == (b.local_rank, b.local_rank, f"mlx5_{b.local_rank}")
        assert b.numa == (0 if b.local_rank < 4 else 1)
        assert len(b.cpus) == 112 // 4  # 4 ranks share a NUMA node's 112 hardware threads
    node0 = [set(b.cpus) for b in bindings[:8]]
    assert all(not (a & b) for i, a in enumerate(node0) for b in node0[i + 1 :])  # disjoint
    assert bindings[8].host == "n2" and bindings[8].node_rank == 1


def test_four_gpus_share_two_nics_asymmetrically():
    bindings = map_ranks(preset("gpu4_nic2"), ["a"], 4)
    assert [(b.gpu, b.nic, b.numa) for b in bindings] == [(0, "mlx5_0", 0), (1, "mlx5_0", 0), (2, "mlx5_1", 1), (3, "mlx5_1", 1)]
    assert bindings[0].cpus == tuple(range(0, 16)) and bindings[1].cpus == tuple(range(16, 32))


def test_fewer_tasks_than_gpus_and_cpu_only_nodes():
    two = map_ranks(preset("dgx_h100"), ["a"], 2)
    assert [b.nic for b in two] == ["mlx5_0", "mlx5_1"] and len(two[0].cpus) == 56
    cpu = map_ranks(preset("cpu"), ["a", "b"], 3)
    assert all(b.gpu is None and b.nic is None and b.cpus == () for b in cpu)


@pytest.mark.parametrize(
    "change, tasks, message",
    [
        (dict(), 9, "8 GPUs per node but resources.tasks_per_node=9"),
        (dict(nics=["mlx5_0", "mlx5_1"]), 8, "uses rails"),
        (dict(rail_of_gpu=[0, 1]), 2, "rail_of_gpu lists 2 GPUs"),
        (dict(numa_cpus=["0-55", ""]), 8, "NUMA node 1 has no CPUs"),
        (dict(numa_of_nic=[0, 0]), 8, "numa_of_nic has 2 entries for 8 NICs"),
    ],
)
def test_impossible_topologies_are_refused(change, tasks, message):
    with pytest.raises(UserError, match=message):
        map_ranks(replace(preset("dgx_h100"), **change), ["a"], tasks)


TOPOLOGY_CONF = """
# two leaves under one spine
SwitchName=leaf1 Nodes=n[1-4]
SwitchName=leaf2 Nodes=n[5-8]
SwitchName=spine Switches=leaf[1-2]
"""


def test_topology_conf_parses_and_counts_hops():
    tree = parse_topology_conf(TOPOLOGY_CONF)
    assert tree.leaf_of["n3"] == "leaf1" and tree.parent_of["leaf2"] == "spine"
    assert tree.hops("n1", "n4") == 0 and tree.hops("n1", "n5") == 2


def test_ring_order_keeps_neighbours_on_a_leaf():
    tree = parse_topology_conf(TOPOLOGY_CONF)
    interleaved = ["n1", "n5", "n2", "n6", "n3", "n7", "n4", "n8"]
    ordered = order_for_ring(tree, interleaved)
    assert ordered == ["n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8"]
    assert ring_hops(tree, interleaved) == 16 and ring_hops(tree, ordered) == 4


@pytest.mark.parametrize(
    "text, message",
    [("SwitchName=s1 Nodes=n[1-", "bad host list"), ("Nodes=n1", "no SwitchName"), ("SwitchName=s1 Nodes", "expected Key=Value"), ("", "no Nodes=")],
)
def test_malformed_topology_conf_is_refused(text, message):
    with pytest.raises(UserError, match=message):
        parse_topology_conf(text)


def test_hosts_missing_from_the_tree_are_named():
    with pytest.raises(UserError, match="n9 are not under any switch"):
        order_for_ring(parse_topology_conf(TOPOLOGY_CONF), ["n1", "n9"])


def test_show_prints_the_mapping_and_ring_order(tmp_path):
    import subprocess
    import sys

    from tests.support.runs import ROOT

    conf = tmp_path / "topology.conf"
    conf.write_text(TOPOLOGY_CONF)
    args = [
        sys.executable,
        "-m",
        "hpc.topology",
        "show",
        "--hosts",
        "n[1-2],n[5-6]",
        "--topology-conf",
        str(conf),
        "topology=dgx_h100",
        "resources.nodes=4",
        "resources.tasks_per_node=8",
    ]
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "4 inter-switch hops as given, 4 after ordering" in out.stdout
    assert len([line for line in out.stdout.splitlines() if line[:1].isdigit()]) == 32
    bad = subprocess.run([*args[:-1], "resources.tasks_per_node=9"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: topology=dgx_h100 has 8 GPUs")
