"""Detect a compute node's topology (NUMA CPUs, InfiniBand HCAs, GPU -> NIC rails) from sysfs and
`nvidia-smi topo -m`, and write it out as a `conf/topology/` preset; count this machine's GPUs
(`count_gpus`: CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`, else /proc/driver/nvidia/gpus).

    python -m hpc.topology detect [--name NAME] [--write conf/topology/NAME.yaml]

Sources: /sys/devices/system/node/node*/cpulist (NUMA node -> CPUs), /sys/class/infiniband/*
with device/numa_node (HCAs and their NUMA node), and the GPU x NIC matrix of `nvidia-smi topo -m`
(each GPU's rail is the NIC it reaches over the fewest PCIe hops; NICs no GPU prefers, such as
storage HCAs, are left out). Pure parsing functions take text and paths, so tests feed them
captured output and fake sysfs trees; whoever runs nvidia-smi passes its output in.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from hpc.errors import UserError
from hpc.fabric.topology import TopologyConfig

# Best first: the PCIe distance classes of `nvidia-smi topo -m`.
LINK_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}


@dataclass(frozen=True)
class GpuNicMatrix:
    gpus: list[str]  # GPU0, GPU1, ...
    nics: list[str]  # device names (mlx5_0) when the NIC legend gives them, else NIC0, ...
    links: dict[tuple[str, str], str]  # (gpu, nic) -> PIX/PXB/PHB/NODE/SYS
    gpu_numa: dict[str, int]  # from the NUMA Affinity column, when present


def _natural(name: str) -> tuple[object, ...]:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def parse_nvidia_smi_topo(text: str) -> GpuNicMatrix:
    """The GPU x NIC part of `nvidia-smi topo -m` output."""
    lines = [line for line in text.splitlines() if line.strip()]
    at = next((i for i, line in enumerate(lines) if re.match(r"\s*GPU0\b", line)), None)
    if at is None:
        raise UserError("nvidia-smi topo -m output has no GPU0 header line")
    header = lines[at].split()
    devices = [token for token in header if re.fullmatch(r"(GPU|NIC|mlx\S*)\d*", token)]
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, flags=re.MULTILINE))
    gpus, links, gpu_numa = [], {}, {}
    for line in lines[at + 1 :]:
        tokens = line.split()
        if not tokens or not re.fullmatch(r"GPU\d+", tokens[0]) or len(tokens) < len(devices) + 1:
            continue
        gpu, values, rest = tokens[0], tokens[1 : len(devices) + 1], tokens[len(devices) + 1 :]
        gpus.append(gpu)
        for device, value in zip(devices, values, strict=True):
            if not device.startswith("GPU"):
                links[(gpu, legend.get(device, device))] = value
        # rest: CPU Affinity, NUMA Affinity[, GPU NUMA ID]; the NUMA node is the first plain number after the CPUs
        numa = [token for token in rest[1:] if token.isdigit()]
        if numa:
            gpu_numa[gpu] = int(numa[0])
    nics = [legend.get(device, device) for device in devices if not device.startswith("GPU")]
    if not gpus:
        raise UserError("nvidia-smi topo -m output lists no GPU rows")
    return GpuNicMatrix(gpus, nics, links, gpu_numa)


def rails_from_matrix(matrix: GpuNicMatrix) -> tuple[list[str], list[int]]:
    """(the NICs GPUs use, in rail order; rail of each GPU). Each GPU takes its closest NIC;
    ties go to a NIC no GPU has taken yet, so GPU i -> NIC i on rail-optimized nodes."""
    chosen: list[str] = []
    for gpu in matrix.gpus:
        ranked = sorted((LINK_RANK.get(matrix.links.get((gpu, nic), "SYS"), 9), nic in chosen, _natural(nic), nic) for nic in matrix.nics)
        if not ranked or ranked[0][0] >= LINK_RANK["SYS"] + 1:
            raise UserError(f"nvidia-smi topo -m: {gpu} reaches no NIC")
        chosen.append(ranked[0][3])
    used = sorted(set(chosen), key=chosen.index)
    return used, [used.index(nic) for nic in chosen]


def numa_cpus_from_sysfs(sys_root: Path) -> list[str]:
    nodes = sorted((sys_root / "devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    return [(node / "cpulist").read_text().strip() for node in nodes]


def hcas_from_sysfs(sys_root: Path) -> dict[str, int]:
    """HCA name -> NUMA node (0 where the kernel reports -1: one NUMA node, or unknown)."""
    hcas = {}
    for hca in sorted((sys_root / "class/infiniband").glob("*"), key=lambda p: _natural(p.name)):
        numa_file = hca / "device/numa_node"
        numa = int(numa_file.read_text().strip()) if numa_file.is_file() else -1
        hcas[hca.name] = max(numa, 0)
    return hcas


def detect_topology(name: str = "detected", sys_root: Path = Path("/sys"), topo_text: str | None = None) -> TopologyConfig:
    numa_cpus = numa_cpus_from_sysfs(sys_root)
    hcas = hcas_from_sysfs(sys_root)
    if topo_text is None:  # no GPUs (or no nvidia-smi): every HCA is a rail, local rank i -> HCA i mod n
        return TopologyConfig(name=name, nics=list(hcas), numa_of_nic=_clamp(list(hcas.values()), numa_cpus), numa_cpus=numa_cpus)
    matrix = parse_nvidia_smi_topo(topo_text)
    nics, rail_of_gpu = rails_from_matrix(matrix) if matrix.nics else ([], [])
    numa_of_nic = []
    for rail, nic in enumerate(nics):
        if nic in hcas:
            numa_of_nic.append(hcas[nic])
        else:  # not in sysfs under that name: the NUMA node of the first GPU on this rail
            numa_of_nic.append(matrix.gpu_numa.get(matrix.gpus[rail_of_gpu.index(rail)], 0))
    return TopologyConfig(
        name=name, gpus_per_node=len(matrix.gpus), nics=nics, rail_of_gpu=rail_of_gpu, numa_of_nic=_clamp(numa_of_nic, numa_cpus), numa_cpus=numa_cpus
    )


def _clamp(numa_of_nic: list[int], numa_cpus: list[str]) -> list[int]:
    """A NUMA node sysfs lists no CPUs for (memory-only, or hidden in a container) -> the last one."""
    return [min(numa, max(len(numa_cpus) - 1, 0)) for numa in numa_of_nic]


def to_yaml(topo: TopologyConfig, where: str | None = None) -> str:
    def flow(items: list[object]) -> str:
        return "[" + ", ".join(f'"{item}"' if isinstance(item, str) else str(item) for item in items) + "]"

    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            f"# Detected on {where or socket.gethostname()} at {stamp} by `python -m hpc.topology detect`.",
            f"name: {topo.name}",
            f"gpus_per_node: {topo.gpus_per_node}",
            f"nics: {flow(list(topo.nics))}",
            f"rail_of_gpu: {flow(list(topo.rail_of_gpu))}",
            f"numa_of_nic: {flow(list(topo.numa_of_nic))}",
            f"numa_cpus: {flow(list(topo.numa_cpus))}",
            f"transport: {topo.transport}",
            "",
        ]
    )


PROC_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU (its PCI address) where the driver is loaded


@dataclass(frozen=True)
class GpuCount:
    """How many GPUs this machine gives a job, and where that was read ("" when none was found)."""

    count: int
    source: str


def visible_gpus(value: str) -> int:
    """The GPUs CUDA_VISIBLE_DEVICES lets a process see, as CUDA reads it: its entries up to the
    first that names no device ("" and "-1": none; "0,1", "GPU-<uuid>,MIG-<uuid>": two)."""
    count = 0
    for entry in (part.strip() for part in value.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return count


def parse_nvidia_smi_list(text: str) -> int:
    """The GPUs `nvidia-smi -L` lists (`GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)`); the MIG
    devices it indents under a GPU are not counted apart."""
    return sum(1 for line in text.splitlines() if re.match(r"GPU \d+:", line))


def count_gpus(env: Mapping[str, str], nvidia_smi_list: Callable[[], str | None], proc_gpus: Path = PROC_GPUS) -> GpuCount:
    """This machine's GPUs, the one rule for it: CUDA_VISIBLE_DEVICES when set, else the GPUs
    `nvidia-smi -L` lists (`nvidia_smi_list` returns its output, None where it is missing or
    fails; called only when needed), else the entries of /proc/driver/nvidia/gpus; 0 if none."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return GpuCount(visible_gpus(env["CUDA_VISIBLE_DEVICES"]), "CUDA_VISIBLE_DEVICES")
    listed = nvidia_smi_list()
    if listed is not None and (count := parse_nvidia_smi_list(listed)):
        return GpuCount(count, "nvidia-smi")
    try:
        entries = sum(1 for _ in proc_gpus.iterdir())
    except OSError:  # no driver loaded (or not readable): no GPUs found there
        entries = 0
    return GpuCount(entries, str(proc_gpus)) if entries else GpuCount(0, "")
