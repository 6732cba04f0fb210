"""`python -m hpc.topology {show,place,detect}`: a job's rank mapping and ring order, the fewest
leaf switches for it, and this node's hardware as a conf/topology preset."""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import hostlist

from hpc.cli import Parser
from hpc.config.compose import compose_job
from hpc.errors import UserError
from hpc.fabric.detect import detect_topology, to_yaml
from hpc.fabric.topology import check_topology, map_ranks, order_for_ring, parse_topology_conf, plan_placement, render_mapping, ring_hops


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """`python -m hpc.topology {show,place,detect} ...`: one sub-parser per command, each with its own --help."""
    parser = Parser(
        "python -m hpc.topology",
        "show: the rank mapping and ring order of a job; place: the fewest leaf switches for it "
        "(sbatch --switches); detect: this node's topology as a conf/topology preset.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{show,place,detect}", parser_class=Parser)
    show = commands.add_parser(
        "show",
        help="the rank -> node/GPU/NIC/rail/NUMA/CPU mapping of a job, in ring order",
        description="The rank mapping of the job the overrides compose, and its ring order over the switches.",
    )
    place = commands.add_parser(
        "place",
        help="the fewest leaf switches that hold the job (for cluster.switches)",
        description="The fewest leaf switches of topology.conf that hold resources.nodes nodes, and the ring order over them.",
    )
    detect = commands.add_parser(
        "detect",
        help="this node's GPUs, NICs and NUMA as a conf/topology preset",
        description="This node's topology (nvidia-smi topo -m, sysfs) as a conf/topology preset, printed or written.",
    )
    show.add_argument("--hosts", help="the job's nodes, a Slurm hostlist (default: node[1-N])")
    show.add_argument("--topology-conf", type=Path, help="Slurm topology.conf to order the ring by")
    place.add_argument("--topology-conf", type=Path, required=True, help="Slurm topology.conf (required)")
    place.add_argument("--hosts", help="the nodes available, a Slurm hostlist (default: all in topology.conf)")
    for sub in (show, place):
        sub.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. topology=dgx_h100 resources.nodes=4")
    detect.add_argument("--name", default="detected", help="the preset's name (default: detected)")
    detect.add_argument("--write", type=Path, help="write the preset to this YAML file (e.g. conf/topology/NAME.yaml)")
    return parser, dict(commands.choices)


def main(argv: list[str]) -> int:
    parser, commands = _parser()
    if argv and argv[0] in commands:
        # Overrides and options mix in any order, which argparse allows only for a parser
        # without sub-parsers: parse the words after the command with its own parser
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
    else:
        args = parser.parse_args(argv)  # --help, or one line on what is wrong
    try:
        if args.command == "detect":
            return _detect(args.name, args.write)
        job = compose_job(args.overrides)
        if args.command == "place":
            tree = parse_topology_conf(args.topology_conf.read_text())
            available = hostlist.expand_hostlist(args.hosts) if args.hosts else None
            plan = plan_placement(tree, job.resources.nodes, available)
            print(f"{job.resources.nodes} nodes on {plan.switches} leaf switch{'es' if plan.switches > 1 else ''}: {', '.join(plan.leaves)}")
            print(f"nodes in ring order: {','.join(plan.hosts)} ({ring_hops(tree, plan.hosts)} inter-switch hops)")
            print(f"submit with: cluster.switches={plan.switches} (sbatch --switches={plan.switches}@{job.cluster.switches_wait_min})")
            return 0
        hosts = hostlist.expand_hostlist(args.hosts) if args.hosts else [f"node{i + 1}" for i in range(job.resources.nodes)]
        if len(hosts) != job.resources.nodes:
            raise UserError(f"--hosts names {len(hosts)} hosts but resources.nodes={job.resources.nodes}")
        if args.topology_conf:
            tree = parse_topology_conf(args.topology_conf.read_text())
            ordered = order_for_ring(tree, hosts)
            print(f"ring over {len(hosts)} nodes: {ring_hops(tree, hosts)} inter-switch hops as given, {ring_hops(tree, ordered)} after ordering by switch")
            print("node order: " + ",".join(ordered))
            hosts = ordered
        print(render_mapping(map_ranks(job.topology, hosts, job.resources.tasks_per_node)))
    except (UserError, OSError, hostlist.BadHostlist) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def nvidia_smi_topo() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else None


def _detect(name: str, write: object) -> int:
    if not name.replace("_", "").isalnum():
        raise UserError(f"--name {name!r}: use letters, digits and underscores (it becomes topology={name})")
    topo_text = nvidia_smi_topo()
    topo = detect_topology(name, topo_text=topo_text)
    check_topology(topo, max(topo.gpus_per_node, 1))
    text = to_yaml(topo, socket.gethostname())
    if topo_text is None:
        text = text.replace("\n", "\n# No nvidia-smi here: GPUs not detected (gpus_per_node 0).\n", 1)
    if write is None:
        print(text, end="")
        return 0
    path = Path(str(write))
    if path.exists():
        raise UserError(f"{path} exists; remove it or choose another --write path")
    path.write_text(text)
    print(f"wrote {path}: use it with topology={path.stem} (from conf/topology/)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
