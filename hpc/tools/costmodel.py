"""`python -m hpc.costmodel`: the alpha-beta model of a flat ring vs the rail-aware
hierarchical allreduce, for a large cluster (hpc/fabric/costmodel.py)."""

from __future__ import annotations

import sys

from hpc.cli import Parser
from hpc.fabric import costmodel
from hpc.fabric.costmodel import Fabric, render_table


def main(argv: list[str]) -> int:
    # No arguments yet: the parser is there for --help and to refuse what it does not know
    Parser("python -m hpc.costmodel", (costmodel.__doc__ or "") + "\nPrints the model for 128 nodes x 8 GPUs, 400 Gb/s rails, at 1 MiB to 1 GiB.").parse_args(
        argv
    )
    fabric = Fabric(nodes=128, gpus_per_node=8, rail_gbps=50e9, intra_gbps=450e9)
    print(
        f"{fabric.nodes} nodes x {fabric.gpus_per_node} GPUs, {fabric.rail_gbps * 8 / 1e9:.0f} Gb/s per rail, "
        f"{fabric.intra_gbps / 1e9:.0f} GB/s intra-node, alpha {fabric.alpha_inter_s * 1e6:g}/{fabric.alpha_intra_s * 1e6:g} us"
    )
    print(render_table(fabric, [2**20, 16 * 2**20, 256 * 2**20, 2**30]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
