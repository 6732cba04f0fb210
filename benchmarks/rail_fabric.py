"""Flat ring vs rail-aware hierarchical allreduce on an emulated rail-optimized fabric (root).

    python benchmarks/rail_fabric.py [--nodes 2] [--rails 2] [--rate 400mbit] [--sizes 16,64] [--rounds 3]

Builds the fabric with scripts/rail-fabric.sh (N node namespaces, one tbf-shaped veth per rail
into a bridge per rail), starts N x RAILS ranks with Open MPI inside the node namespaces (each
node its own hostname, so Open MPI uses TCP between nodes and shared memory only inside one),
binds every rank with the toolkit's own binding (local rank r -> interface rail<r>), and times,
side by side in one run, our flat node-major ring over all ranks against our hierarchical
allreduce (node communicator + one communicator per rail). The alpha-beta model's prediction
for the same shape is printed beside each figure: its rail bandwidth is the tbf rate, its
intra-node bandwidth is measured in the same run (a ring over each node's ranks). Tears the
fabric down afterwards, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FABRIC = ROOT / "scripts" / "rail-fabric.sh"
ALPHA_INTER_S = 100e-6  # TCP over veth; negligible against >= 16 MiB at these rates


def rate_bytes_per_s(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate.removesuffix(unit)) * scale / 8
    raise SystemExit(f"--rate {rate!r}: expected e.g. 400mbit or 1gbit")


# --- inside the fabric: one process per rank ----------------------------------------------------


def worker(rails: int, sizes_mib: list[int], rounds: int) -> None:
    from hpc.env import RankInfo
    from hpc.fabric.topology import TopologyConfig
    from hpc.rank.binding import apply_binding, binding_for

    topo = TopologyConfig(name="emulated_rails", nics=[f"rail{r}" for r in range(rails)], transport="tcp")
    rank = RankInfo.from_env(os.environ)
    binding_line = apply_binding(binding_for(topo, rank), topo)  # before MPI initialises

    import torch
    from mpi4py import MPI

    from collectives.bench import measure
    from collectives.mpi import MpiCollectives

    comm = MPI.COMM_WORLD
    lines = comm.gather(f"rank {rank.rank} on {rank.host}: {binding_line}, btl_tcp_if_include={os.environ.get('OMPI_MCA_btl_tcp_if_include')}", root=0)
    flat = MpiCollectives(comm, "ring", rank.node_rank, rank.local_rank)
    hier = MpiCollectives(comm, "hierarchical", rank.node_rank, rank.local_rank)
    node_comm = comm.Split(color=rank.node_rank, key=rank.local_rank)
    intra = MpiCollectives(node_comm, "ring")
    results = []
    for size in sizes_mib:
        nbytes = size << 20
        runs: dict[str, list[float]] = {"flat": [], "hierarchical": [], "intra": []}
        errors = []
        for engine in (flat, hier, intra):  # connect every pair once (Open MPI connects lazily)
            buf = torch.ones(nbytes // 4)
            engine.allreduce_(buf, "sum")
        for _ in range(rounds):  # interleaved: the machine is shared and noisy
            for name, engine in (("flat", flat), ("hierarchical", hier)):
                seconds, error = measure(comm, lambda buf, e=engine: e.allreduce_(buf, "sum"), nbytes, warmup=0, iters=1)
                runs[name].append(seconds)
                errors.append(error)
            seconds, _ = measure(comm, lambda buf: intra.allreduce_(buf, "sum"), nbytes, warmup=0, iters=1)
            runs["intra"].append(seconds)
        results.append({"mib": size, **{name: statistics.median(v) for name, v in runs.items()}, "max_error": max(errors), "raw": runs})
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"bindings": lines, "results": results}), flush=True)
    for engine in (flat, hier, intra):
        engine.close()


# --- the driver ---------------------------------------------------------------------------------


def fabric(*args: str) -> str:
    done = subprocess.run(["bash", str(FABRIC), *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr.strip() or f"rail-fabric.sh {' '.join(args)} failed")
    return done.stdout.strip()


def run_in_fabric(nodes: int, rails: int, sizes: list[int], rounds: int, timeout_s: float) -> dict:
    hosts = ",".join(f"rn{k}:{rails}" for k in range(nodes))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_mpi_yield_when_idle": "1"}
    command = [
        "ip",
        "netns",
        "exec",
        "hpcrail-fabric",
        "mpirun",
        "--allow-run-as-root",
        "-n",
        str(nodes * rails),
        "--host",
        hosts,
        "--map-by",
        "slot",
        "--bind-to",
        "none",
        "--mca",
        "plm_rsh_agent",
        f"bash {FABRIC} agent",
        "--mca",
        "oob_tcp_if_include",
        "br-mgmt,mgmt",
        # Open MPI 4.1's TCP transport halves its rate when both directions of a link carry a
        # large message at once with its emulated-RDMA (PUT) protocol: measured 12.1 vs 24.1 MB/s
        # at 200 Mbit with 2 ranks per core; plain send/receive fragments run at the line rate.
        "--mca",
        "btl",
        "tcp,vader,self",
        "--mca",
        "btl_tcp_flags",
        "send",
        "-x",
        "PYTHONPATH",
        "-x",
        "OMPI_MCA_mpi_yield_when_idle",
        sys.executable,
        "-u",
        str(Path(__file__).resolve()),
        "--worker",
        "--rails",
        str(rails),
        "--sizes",
        ",".join(map(str, sizes)),
        "--rounds",
        str(rounds),
    ]
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"mpirun in the fabric failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rails", type=int, default=2, help="rails per node = ranks per node")
    parser.add_argument("--rate", default="400mbit", help="tbf rate of every rail link")
    parser.add_argument("--sizes", default="16,64", help="MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=540)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.rails, sizes, args.rounds)
        return

    from hpc.fabric.costmodel import (
        Fabric,
        bus_bandwidth,
        flat_ring_seconds,
        hierarchical_seconds,
    )

    rail_bw = rate_bytes_per_s(args.rate)
    fabric("up", str(args.nodes), str(args.rails), args.rate)
    try:
        measured = run_in_fabric(args.nodes, args.rails, sizes, args.rounds, args.timeout)
    finally:
        fabric("down")
    for line in measured["bindings"]:
        print(line)
    g, n = args.rails, args.nodes
    print(f"\n{n} nodes x {g} rails, tbf {args.rate} per rail link ({rail_bw / 1e6:.0f} MB/s), {args.rounds} interleaved rounds, medians")
    print(
        "| size | flat ring busbw MB/s | hierarchical busbw MB/s | hier / (G x flat) | model hier busbw MB/s "
        "| measured / model | model flat busbw MB/s | max error |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in measured["results"]:
        nbytes = row["mib"] << 20
        # Intra-node bandwidth for the model, from the node ring timed in the same run.
        intra_ring = Fabric(nodes=1, gpus_per_node=g, rail_gbps=rail_bw, intra_gbps=1.0, alpha_intra_s=0.0)
        intra_bw = flat_ring_seconds(intra_ring, nbytes) / row["intra"] if g > 1 else 1e12
        model = Fabric(nodes=n, gpus_per_node=g, rail_gbps=rail_bw, intra_gbps=intra_bw, alpha_inter_s=ALPHA_INTER_S, alpha_intra_s=0.0)
        shape = Fabric(n, g, rail_bw, intra_bw)
        flat_bus, hier_bus = bus_bandwidth(shape, nbytes, row["flat"]), bus_bandwidth(shape, nbytes, row["hierarchical"])
        model_hier = bus_bandwidth(shape, nbytes, hierarchical_seconds(model, nbytes))
        model_flat = bus_bandwidth(shape, nbytes, flat_ring_seconds(model, nbytes))
        print(
            f"| {row['mib']} MiB | {flat_bus / 1e6:.1f} | {hier_bus / 1e6:.1f} | {hier_bus / (g * flat_bus):.2f} | "
            f"{model_hier / 1e6:.1f} | {hier_bus / model_hier:.2f} | {model_flat / 1e6:.1f} | {row['max_error']:.1e} |"
        )


if __name__ == "__main__":
    main()
