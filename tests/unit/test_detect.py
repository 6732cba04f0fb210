"""Topology detection (sysfs, nvidia-smi topo -m), presets written from it, and placement."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hpc.errors import UserError
from hpc.fabric.detect import detect_topology, parse_nvidia_smi_topo, rails_from_matrix, to_yaml
from hpc.fabric.topology import TopologyConfig, check_topology, map_ranks, parse_cpu_list, parse_topology_conf, plan_placement, ring_hops

ROOT = Path(__file__).resolve().parents[2]

# `nvidia-smi topo -m` as a DGX H100 prints it (8 GPUs; 8 compute HCAs, each behind the same
# PCIe switch as its GPU; 2 storage HCAs one per socket at NODE distance; NIC legend at the end).
_DGX_GPU_NICS = {g: g if g < 4 else g + 1 for g in range(8)}  # mlx5_4 and mlx5_9 serve storage
_NUMA_OF_GPU = [0, 0, 0, 0, 1, 1, 1, 1]


def dgx_h100_topo() -> str:
    nics = [f"NIC{i}" for i in range(10)]
    header = "\t" + "\t".join([f"GPU{g}" for g in range(8)] + nics + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])
    rows = [header]
    for g in range(8):
        cells = [" X " if h == g else "NV18" for h in range(8)]
        for n in range(10):
            same_socket = (n < 5) == (g < 4)
            cells.append("PXB" if n == _DGX_GPU_NICS[g] else ("NODE" if same_socket else "SYS"))
        cpus = "0-55,112-167" if g < 4 else "56-111,168-223"
        rows.append(f"GPU{g}\t" + "\t".join(cells) + f"\t{cpus}\t{_NUMA_OF_GPU[g]}\t\tN/A")
    legend = ["", "Legend:", "", "  X    = Self", "  PXB  = Connection traversing multiple PCIe bridges", "", "NIC Legend:", ""]
    legend += [f"  NIC{i}: mlx5_{i}" for i in range(10)]
    return "\n".join(rows + legend) + "\n"


def fake_sysfs(root: Path, numa_cpus: list[str], hcas: dict[str, int]) -> Path:
    for index, cpus in enumerate(numa_cpus):
        node = root / "devices/system/node" / f"node{index}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(cpus + "\n")
    for name, numa in hcas.items():
        device = root / "class/infiniband" / name / "device"
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{numa}\n")
    return root


def test_dgx_h100_is_detected_as_eight_rails_without_the_storage_nics(tmp_path):
    hcas = {f"mlx5_{i}": (0 if i < 5 else 1) for i in range(10)}
    sysfs = fake_sysfs(tmp_path, ["0-55,112-167", "56-111,168-223"], hcas)
    topo = detect_topology("dgx", sysfs, dgx_h100_topo())
    assert topo.gpus_per_node == 8
    assert topo.nics == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8"]
    assert topo.rail_of_gpu == list(range(8)) and topo.numa_of_nic == [0, 0, 0, 0, 1, 1, 1, 1]
    check_topology(topo, 8)
    bindings = map_ranks(topo, ["n1", "n2"], 8)
    assert [(b.gpu, b.nic, b.numa) for b in bindings[4:6]] == [(4, "mlx5_5", 1), (5, "mlx5_6", 1)]
    assert bindings[4].cpus[0] == 56  # local rank 4 gets CPUs of NUMA node 1


def test_four_gpus_sharing_two_nics_get_two_rails():
    text = "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\n"
    rows = {0: ("PIX", "SYS", 0), 1: ("PIX", "SYS", 0), 2: ("SYS", "PIX", 1), 3: ("SYS", "PIX", 1)}
    for g, (a, b, numa) in rows.items():
        text += f"GPU{g}\t" + "\t".join(" X " if h == g else "NV4" for h in range(4)) + f"\t{a}\t{b}\t0-15\t{numa}\n"
    text += "\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n"
    matrix = parse_nvidia_smi_topo(text)
    assert matrix.gpu_numa == {"GPU0": 0, "GPU1": 0, "GPU2": 1, "GPU3": 1}
    assert rails_from_matrix(matrix) == (["mlx5_0", "mlx5_1"], [0, 0, 1, 1])


def test_a_written_preset_loads_back_into_the_same_topology(tmp_path):
    sysfs = fake_sysfs(tmp_path / "sys", ["0-55,112-167", "56-111,168-223"], {f"mlx5_{i}": (0 if i < 5 else 1) for i in range(10)})
    topo = detect_topology("dgx_detected", sysfs, dgx_h100_topo())
    loaded = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TopologyConfig), OmegaConf.create(to_yaml(topo, "n1"))))
    assert loaded == topo


def test_detection_on_this_machine_matches_its_cpus():
    topo = detect_topology("here")
    cpus = sorted(c for text in topo.numa_cpus for c in parse_cpu_list(text))
    assert topo.numa_cpus and set(os.sched_getaffinity(0)) <= set(cpus)
    check_topology(topo, 1)
    shown = subprocess.run([sys.executable, "-m", "hpc.topology", "detect", "--name", "here"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "name: here" in shown and f'numa_cpus: ["{topo.numa_cpus[0]}"' in shown


def test_detect_refuses_bad_names_and_existing_files(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "hpc.topology", "detect", "--name", "a b"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --name 'a b'")
    target = tmp_path / "mine.yaml"
    first = subprocess.run([sys.executable, "-m", "hpc.topology", "detect", "--name", "mine", "--write", str(target)], cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0 and "name: mine" in target.read_text()
    again = subprocess.run([sys.executable, "-m", "hpc.topology", "detect", "--name", "mine", "--write", str(target)], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr


def test_malformed_nvidia_smi_output_is_refused():
    with pytest.raises(UserError, match="no GPU0 header"):
        parse_nvidia_smi_topo("No devices were found\n")


TREE = "SwitchName=s1 Nodes=n[1-4]\nSwitchName=s2 Nodes=n[5-6]\nSwitchName=s3 Nodes=n[7-12]\nSwitchName=spine Switches=s[1-3]\n"


@pytest.mark.parametrize(("nodes", "switches"), [(1, 1), (6, 1), (7, 2), (10, 2), (11, 3), (12, 3)])
def test_placement_uses_the_fewest_leaf_switches(nodes, switches):
    tree = parse_topology_conf(TREE)
    plan = plan_placement(tree, nodes)
    assert plan.switches == switches and len(plan.hosts) == nodes and len(set(plan.hosts)) == nodes
    assert {tree.leaf_of[h] for h in plan.hosts} == set(plan.leaves)
    assert ring_hops(tree, plan.hosts) == (0 if switches == 1 else 2 * switches)  # one crossing per leaf boundary


def test_placement_respects_available_hosts_and_refuses_too_many():
    tree = parse_topology_conf(TREE)
    assert plan_placement(tree, 3, ["n1", "n5", "n6", "n7"]).leaves == ["s2", "s1"]
    with pytest.raises(UserError, match="cannot place 5 nodes on 4 available hosts"):
        plan_placement(tree, 5, ["n1", "n5", "n6", "n7"])


def test_place_cli_prints_the_switches_override(tmp_path):
    conf = tmp_path / "topology.conf"
    conf.write_text(TREE)
    done = subprocess.run(
        [sys.executable, "-m", "hpc.topology", "place", "--topology-conf", str(conf), "resources.nodes=8"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "8 nodes on 2 leaf switches: s3, s1" in done and "cluster.switches=2 (sbatch --switches=2@10)" in done
