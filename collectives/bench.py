"""Allreduce benchmark with nccl-tests semantics, every implementation side by side in one run.

    python -m collectives.bench --np 4 -b 8 -e 64M -f 2 -w 5 -n 20 --out results/
    mpirun -np 4 python -m collectives.bench ...          (or srun --mpi=pmix ...)

Per message size (bytes of each rank's buffer) and implementation: time per allreduce (median
over timed iterations, of the slowest rank), algbw = bytes / time, busbw = algbw * 2(n-1)/n, and
the largest error against a float64 reference. Implementations: our ring, rhd (recursive
halving/doubling), auto, hierarchical (with --ranks-per-node), MPI_Allreduce through mpi4py,
torch.distributed Gloo, and Horovod when it imports. Writes bench.json, bench.md, bench.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from datetime import date
from pathlib import Path
from typing import Any

import torch

from collectives.mpirun import find_mpirun, mpirun_command, root_environment

IMPLEMENTATIONS = ("ring", "rhd", "auto", "hierarchical", "mpi", "gloo", "horovod")
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in UNITS else ""
    try:
        return int(float(text[: len(text) - len(unit)]) * UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 16M)") from None


def sizes_between(begin: int, end: int, factor: int) -> list[int]:
    if begin < 1 or end < begin or factor < 2:
        raise ValueError("need 1 <= -b <= -e and -f >= 2")
    sizes, size = [], begin
    while size <= end:
        sizes.append(size)
        size *= factor
    return sizes


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s, as nccl-tests defines them for allreduce."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * 2 * (world - 1) / world


# --- implementations: each returns fn(buffer) reducing a float32 tensor in place (sum) ---------


def make_implementations(names: list[str], ranks_per_node: int | None) -> dict[str, Callable[[torch.Tensor], None]]:
    from mpi4py import MPI

    from collectives.mpi import MpiCollectives

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    node_rank, local_rank = (rank // ranks_per_node, rank % ranks_per_node) if ranks_per_node else (None, None)
    impls: dict[str, Callable[[torch.Tensor], None]] = {}
    for name in names:
        if name in ("ring", "rhd", "auto", "hierarchical", "mpi"):
            if name == "hierarchical" and not ranks_per_node:
                continue
            engine = MpiCollectives(comm, name, node_rank, local_rank)
            impls[name] = functools.partial(engine.allreduce_, op="sum")
        elif name == "gloo":
            impls[name] = _gloo(comm)
        elif name == "horovod":
            horovod = _horovod()
            if horovod is not None:
                impls[name] = horovod
    return impls


def _gloo(comm: Any) -> Callable[[torch.Tensor], None]:
    import torch.distributed as dist

    if not dist.is_initialized():
        address = None
        if comm.Get_rank() == 0:
            with socket.socket() as s:  # a free port on rank 0's host, shared over MPI
                s.bind(("", 0))
                address = (socket.gethostbyname(socket.gethostname()), s.getsockname()[1])
        host, port = comm.bcast(address, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.Get_rank(), world_size=comm.Get_size())
    return lambda buf: dist.all_reduce(buf)


def _horovod() -> Callable[[torch.Tensor], None] | None:
    try:
        import horovod.torch as hvd
    except ImportError:
        return None
    hvd.init()
    return lambda buf: hvd.allreduce_(buf, op=hvd.Sum)


# --- measuring ----------------------------------------------------------------------------------


def measure(comm: Any, impl: Callable[[torch.Tensor], None], nbytes: int, warmup: int, iters: int) -> tuple[float, float]:
    """(seconds per allreduce, max abs error). Inputs are restored before every iteration."""
    world, rank = comm.Get_size(), comm.Get_rank()
    count = max(nbytes // 4, 1)
    pattern = torch.arange(count, dtype=torch.float64).remainder_(97)
    source = ((pattern + 1) * (rank + 1)).to(torch.float32)
    expected = (pattern + 1) * (world * (world + 1) / 2)
    buf = source.clone()
    times = []
    for i in range(warmup + iters):
        buf.copy_(source)
        comm.Barrier()
        started = time.perf_counter()
        impl(buf)
        elapsed = time.perf_counter() - started
        if i >= warmup:
            times.append(elapsed)
    # Median, not mean: on shared, oversubscribed machines a few iterations stall for
    # milliseconds; the slowest rank's median is what a steady training step sees.
    slowest = comm.allreduce(statistics.median(times), op=_mpi_max())
    error = comm.allreduce(float((buf.to(torch.float64) - expected).abs().max()), op=_mpi_max())
    return slowest, error


def _mpi_max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    impls = make_implementations(args.algos, args.ranks_per_node)
    results = []
    for nbytes in sizes_between(args.begin, args.end, args.factor):
        for name, impl in impls.items():
            seconds, error = measure(comm, impl, nbytes, args.warmup, args.iters)
            algbw, busbw = bus_bandwidth(max(nbytes // 4, 1) * 4, seconds, world)
            results.append(
                {"impl": name, "bytes": max(nbytes // 4, 1) * 4, "time_us": seconds * 1e6, "algbw_gbs": algbw, "busbw_gbs": busbw, "max_error": error}
            )
            if comm.Get_rank() == 0:
                print(f"{nbytes:>12d} B  {name:<13s} {seconds * 1e6:>11.1f} us  algbw {algbw:7.3f}  busbw {busbw:7.3f} GB/s  err {error:.1e}", flush=True)
    return results


# --- reporting ------------------------------------------------------------------------------------


def human(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def render_markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in results))
    sizes = sorted({r["bytes"] for r in results})
    by_key = {(r["impl"], r["bytes"]): r for r in results}
    lines = [
        f"{meta['world_size']} ranks on {meta['hosts']}, {meta['date']}: `{meta['command']}`",
        f"(busbw in GB/s; time per allreduce in us in parentheses; max error over all sizes: "
        f"{max(r['max_error'] for r in results):.1e}; not run: {', '.join(meta['not_run']) or 'none'})",
        "",
        "| size | " + " | ".join(impls) + " |",
        "| --- |" + " --- |" * len(impls),
    ]
    for size in sizes:
        cells = [f"{by_key[i, size]['busbw_gbs']:.2f} ({by_key[i, size]['time_us']:.0f})" for i in impls]
        lines.append(f"| {human(size)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def crossover(results: list[dict[str, Any]], faster: str = "ring", slower: str = "rhd") -> int | None:
    """The smallest size from which `faster` beats `slower` at every larger size."""
    sizes = sorted({r["bytes"] for r in results})
    times = {(r["impl"], r["bytes"]): r["time_us"] for r in results}
    if not all((name, s) in times for s in sizes for name in (faster, slower)):
        return None
    for size in sizes:
        if all(times[faster, s] < times[slower, s] for s in sizes if s >= size):
            return size
    return None


def plot(results: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib not installed; no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in dict.fromkeys(r["impl"] for r in results):
        rows = sorted((r for r in results if r["impl"] == impl), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in rows], [r["busbw_gbs"] for r in rows], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"allreduce, {meta['world_size']} ranks, {meta['hosts']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def under_mpi_launcher(env: Mapping[str, str]) -> bool:
    """Started as one of several MPI ranks (mpirun, or srun --mpi=pmix), not alone. The bench's
    own check, made before MPI starts (collectives/ reads no other launcher variable)."""
    sizes = (env.get(key, "") for key in ("OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE"))
    return any(size.isdigit() and int(size) > 1 for size in sizes)


def relaunch_under_mpirun(np_: int, argv: list[str]) -> int:
    mpirun = find_mpirun()
    if mpirun is None:
        print("error: mpirun not found (scripts/install.sh)", file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", **root_environment()}
    args, skip = [], False
    for a in argv:  # drop "--np N" / "--np=N": the ranks started must not start ranks again
        if skip or a.startswith("--np="):
            skip = False
            continue
        skip = a == "--np"
        if not skip:
            args.append(a)
    command = mpirun_command(np_, [sys.executable, "-m", "collectives.bench", *args], mpirun=mpirun)
    return subprocess.run(command, env=env).returncode


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m collectives.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-b", "--begin", type=parse_size, default=parse_size("8"), help="smallest size per rank (8, 64K, 16M)")
    parser.add_argument("-e", "--end", type=parse_size, default=parse_size("64M"), help="largest size per rank")
    parser.add_argument("-f", "--factor", type=int, default=2, help="size multiplier between steps")
    parser.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations per size")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    parser.add_argument("--algos", type=lambda s: s.split(","), default=list(IMPLEMENTATIONS), help=f"comma list of {','.join(IMPLEMENTATIONS)}")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="group ranks into nodes (hierarchical)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for bench.json/.md/.png")
    parser.add_argument("--np", dest="np_", type=int, default=None, help="start this many ranks under mpirun")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.algos) - set(IMPLEMENTATIONS))
    if unknown:
        parser.error(f"unknown --algos {', '.join(unknown)}; choose from {', '.join(IMPLEMENTATIONS)}")
    if args.warmup < 0 or args.iters < 1:
        parser.error("-w must be >= 0 and -n >= 1")
    try:
        sizes_between(args.begin, args.end, args.factor)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.np_ and args.np_ > 1 and not under_mpi_launcher(os.environ):
        # Decided before MPI starts: a singleton MPI process would spin beside the ranks.
        return relaunch_under_mpirun(args.np_, argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if args.ranks_per_node and comm.Get_size() % args.ranks_per_node:
        if comm.Get_rank() == 0:
            print(f"error: --ranks-per-node {args.ranks_per_node} does not divide {comm.Get_size()} ranks", file=sys.stderr)
        return 2
    results = run(args)
    all_hosts = comm.gather(socket.gethostname(), root=0)  # collective: before ranks > 0 leave
    if comm.Get_rank() != 0:
        return 0
    hosts = sorted(set(all_hosts or []))
    run_names = {r["impl"] for r in results}
    meta = {
        "world_size": comm.Get_size(),
        "hosts": ", ".join(hosts),
        "date": date.today().isoformat(),
        "command": "python -m collectives.bench " + " ".join(argv),
        "cpu_count": os.cpu_count(),
        "mpi": MPI.Get_library_version().split(",")[0].strip(),
        "torch": torch.__version__,
        "not_run": [n for n in args.algos if n not in run_names],
        "ring_beats_rhd_from_bytes": crossover(results),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (args.out / "bench.md").write_text(render_markdown(results, meta))
    plotted = plot(results, meta, args.out / "bench.png")
    print(f"bench: wrote {args.out}/bench.json, bench.md{', bench.png' if plotted else ''}; ring beats rhd from {meta['ring_beats_rhd_from_bytes']} B")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
