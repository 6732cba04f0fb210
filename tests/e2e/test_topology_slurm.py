"""Rail-aware binding on the simulated Slurm with fake GPU GRES: 4 nodes x 2 tasks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpc.config.compose import compose_job
from hpc.fabric.topology import map_ranks
from tests.conftest import wait_until_done
from tests.support.runs import ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]


def test_every_rank_binds_to_its_gpu_and_rail_and_hierarchical_matches_mpi_allreduce(tmp_path):
    out = tmp_path / "ranks.out"
    command = f"srun --mpi=pmix {sys.executable} -u tests/e2e/binding_worker.py gpu4_nic2"
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=4",
            "--ntasks-per-node=2",
            "--gres=gpu:2",
            f"--output={out}",
            "--export=ALL,OMPI_MCA_btl_vader_backing_directory=/nodetmp",
            "--wrap",
            command,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    state = wait_until_done(submitted.stdout.strip())
    text = out.read_text()
    assert state == "COMPLETED", text[-3000:]
    ranks = sorted((json.loads(line) for line in text.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert len(ranks) == 8, text[-3000:]
    hosts = [ranks[2 * n]["node"] for n in range(4)]
    assert hosts == sorted(set(hosts)) and len(set(hosts)) == 4  # node-major ranks on 4 nodes
    expected = map_ranks(compose_job(["topology=gpu4_nic2"]).topology, hosts, 2)
    for got, want in zip(ranks, expected, strict=True):
        assert (got["node"], got["local_rank"], got["gpu"], got["nic"], got["rail"]) == (want.host, want.local_rank, want.gpu, want.nic, want.rail)
        assert got["cuda_visible_devices"] == str(want.gpu) and got["nccl_ib_hca"] == f"={want.nic}"
        assert got["slurm_gpus"] == "2"  # Slurm granted 2 fake GPUs per node to the step
        assert f"binding: gpu {want.gpu}, nic {want.nic} (rail {want.rail})" in got["line"]
        # One communicator per node (2 ranks) and per rail (4 ranks, one per node, one NIC rail).
        assert (got["node_comm"], got["rail_comm"]) == (2, 4) and set(got["rail_members"]) == {want.rail}
        assert got["equal"], f"rank {got['rank']}: hierarchical allreduce differs from MPI_Allreduce"


def test_rings_follow_the_switch_tree_from_topology_conf(tmp_path):
    from tests.support.runs import run_dirs, run_launch

    conf = tmp_path / "topology.conf"  # node1 and node3 share a leaf, node2 and node4 the other
    conf.write_text("SwitchName=s1 Nodes=node[1,3]\nSwitchName=s2 Nodes=node[2,4]\nSwitchName=top Switches=s[1-2]\n")
    done = run_launch(
        "cluster=simulated", "resources.nodes=4", "resources.tasks_per_node=1", f"cluster.topology_conf={conf}", "trainer.epochs=1", "wait=true", cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    logs = {path.name: path.read_text() for path in (run_dir / "logs").glob("rank-*.log")}
    assert "ring over 4 nodes ordered by switch: 8 inter-switch hops as allocated, 4 now" in logs["rank-00000.log"]
    positions = {name: int(text.split("this node is number ")[1].split()[0]) for name, text in logs.items()}
    assert positions == {"rank-00000.log": 0, "rank-00001.log": 2, "rank-00002.log": 1, "rank-00003.log": 3}


def test_a_missing_topology_conf_is_refused_before_submission(tmp_path):
    from tests.support.runs import run_launch

    done = run_launch("cluster=simulated", f"cluster.topology_conf={tmp_path / 'nope.conf'}", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == f"error: cluster.topology_conf={tmp_path / 'nope.conf'}: No such file or directory"
