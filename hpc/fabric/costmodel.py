"""Alpha-beta model of allreduce time: a flat node-major ring against the rail-aware
hierarchical allreduce, on a described cluster. Closed forms, no simulation.

A message of n bytes per rank; N nodes of G GPUs; P = N*G ranks. Links: alpha (latency per
message) and bandwidth, separately inside the node (NVLink class) and between nodes (one NIC per
rail). The flat ring crosses node boundaries through one NIC per node, so its bandwidth term is
set by one rail; the hierarchical allreduce runs G inter-node rings at once, one per rail, each
on n/G bytes. Ignored: congestion at the spine, reduction compute, pipelining across steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fabric:
    nodes: int
    gpus_per_node: int
    rail_gbps: float  # bytes/s of one NIC (rail), e.g. 400 Gb/s -> 50e9
    intra_gbps: float  # bytes/s between GPUs of a node (NVLink class)
    alpha_inter_s: float = 5e-6
    alpha_intra_s: float = 2e-6

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node


def flat_ring_seconds(f: Fabric, nbytes: float) -> float:
    p = f.ranks
    if p == 1:
        return 0.0
    # 2(p-1) steps; a step's time is set by its slowest link: an inter-node hop when N > 1.
    alpha, bandwidth = (f.alpha_inter_s, f.rail_gbps) if f.nodes > 1 else (f.alpha_intra_s, f.intra_gbps)
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / bandwidth


def hierarchical_seconds(f: Fabric, nbytes: float) -> float:
    g, n = f.gpus_per_node, f.nodes
    intra = 2 * (g - 1) * f.alpha_intra_s + 2 * (g - 1) / g * nbytes / f.intra_gbps if g > 1 else 0.0
    inter = 2 * (n - 1) * f.alpha_inter_s + 2 * (n - 1) / n * (nbytes / g) / f.rail_gbps if n > 1 else 0.0
    return intra + inter


def bus_bandwidth(f: Fabric, nbytes: float, seconds: float) -> float:
    """nccl-tests busbw in bytes/s: algbw * 2(P-1)/P."""
    p = f.ranks
    return 0.0 if seconds <= 0 else nbytes / seconds * 2 * (p - 1) / p


def render_table(f: Fabric, sizes: list[int]) -> str:
    rows = [
        "| size | flat ring ms | hierarchical ms | flat busbw GB/s | hierarchical busbw GB/s | speedup |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for size in sizes:
        flat, hier = flat_ring_seconds(f, size), hierarchical_seconds(f, size)
        rows.append(
            f"| {size / 2**20:g} MiB | {flat * 1e3:.3f} | {hier * 1e3:.3f} | {bus_bandwidth(f, size, flat) / 1e9:.1f} | "
            f"{bus_bandwidth(f, size, hier) / 1e9:.1f} | {flat / hier:.2f}x |"
        )
    return "\n".join(rows)
