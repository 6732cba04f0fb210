"""Allreduce benchmark with nccl-tests semantics: every implementation in a launch of its own,
in interleaved rounds, against the machine's own memory bound.

    python -m collectives.bench --np 4 --ranks-per-node 2 -b 1M -e 64M -f 4 --rounds 3 --out results/
    mpirun -np 4 python -m collectives.bench ...          (or srun --mpi=pmix ...: one launch)

With --np, each round starts one launch per implementation (in a rotated order), so that no
implementation runs beside another's threads: Horovod's background thread, started in a process,
slowed our engine 3-4x on a 2-core machine. Under a launcher you started, everything runs in that
one launch, in the same interleaved rounds.

Per message size (bytes of each rank's buffer) and implementation: time per allreduce (median
over timed iterations, of the slowest rank; then the median over rounds), algbw = bytes / time,
busbw = algbw * 2(n-1)/n, the largest error against a float64 reference, the fraction of the
shared-memory bound (collectives/bench_report.py), and auto's speed against every other,
paired by round, with the interval that holds its median (faster or slower only when the whole
interval is on one side of 1; 5 rounds or more). Implementations: our ring, rhd (recursive halving/doubling), auto (tuned on
these ranks), hierarchical (with --ranks-per-node), MPI_Allreduce through mpi4py,
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
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import date
from pathlib import Path
from typing import Any

import torch

from collectives import bench_report
from collectives.bench_report import UNITS, bus_bandwidth, human
from collectives.mpirun import find_mpirun, local_ranks_environment, mpirun_command

IMPLEMENTATIONS = ("ring", "rhd", "auto", "hierarchical", "mpi", "gloo", "horovod")
__all__ = ["bus_bandwidth", "human", "main", "measure", "parse_size", "sizes_between"]


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


# --- implementations: each returns fn(buffer) reducing a float32 tensor in place (sum) ---------


Implementation = tuple[Callable[[torch.Tensor], None] | None, dict[str, Any], Callable[[], None]]


def make_implementation(name: str, ranks_per_node: int | None, tuning_cache: str | None) -> Implementation:
    """(fn, notes, close) for one implementation; fn is None where it cannot run here (notes say
    why). Gloo and Horovod stay initialised for later rounds: close() leaves them be."""
    from mpi4py import MPI

    from collectives.mpi import MpiCollectives

    comm = MPI.COMM_WORLD
    if name in ("ring", "rhd", "auto", "hierarchical", "mpi"):
        if name == "hierarchical" and not ranks_per_node:
            return None, {"skipped": "needs --ranks-per-node"}, _nothing
        rank = comm.Get_rank()
        node_rank, local_rank = (rank // ranks_per_node, rank % ranks_per_node) if ranks_per_node else (None, None)
        engine = MpiCollectives(comm, name, node_rank, local_rank)
        notes: dict[str, Any] = {}
        if name == "auto":
            table = engine.tune(tuning_cache)
            if table is not None:
                from collectives import tuning

                notes = {"tuned_in_s": table.tuned_in_s, "choices": tuning.describe(table, tuning.TUNED_SIZES, engine.candidates())}
        return functools.partial(engine.allreduce_, op="sum"), notes, engine.close  # its thread and communicators
    if name == "gloo":
        return _gloo(comm), {}, _nothing
    horovod = _horovod()
    return horovod, {} if horovod else {"skipped": "horovod does not import"}, _nothing


def _nothing() -> None:
    pass


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


def measure_memory(comm: Any, nbytes: int, warmup: int, iters: int) -> dict[str, float]:
    """Copy and in-place add bandwidth (GB/s of destination bytes) with every rank at work at
    once, as in an allreduce: the slowest rank's median."""
    count = max(nbytes // 4, 1)
    a, b, dst = torch.ones(count), torch.ones(count), torch.empty(count)
    out = {}
    for name, kernel in (("copy_gbs", lambda: dst.copy_(a)), ("add_gbs", lambda: a.add_(b))):
        times = []
        for i in range(warmup + iters):
            comm.Barrier()
            started = time.perf_counter()
            kernel()
            if i >= warmup:
                times.append(time.perf_counter() - started)
        slowest = comm.allreduce(statistics.median(times), op=_mpi_max())
        out[name] = count * 4 / slowest / 1e9 if slowest > 0 else 0.0
    return out


def _mpi_max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def run_launch(args: argparse.Namespace, names: list[str], round_: int) -> list[dict[str, Any]]:
    """This launch's records: every implementation in `names`, then the memory bound."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    sizes = sizes_between(args.begin, args.end, args.factor)
    records = []
    for name in names:
        impl, notes, close = make_implementation(name, args.ranks_per_node, args.tuning_cache)
        record: dict[str, Any] = {"impl": name, "round": round_, "results": [], **notes}
        records.append(record)
        if impl is None:
            continue
        measure_sizes(comm, impl, sizes, args, record, world)
        close()
    if records:
        records[-1]["memory"] = [{"bytes": max(n // 4, 1) * 4, **measure_memory(comm, n, 2, max(args.iters // 2, 3))} for n in sizes]
    return records


def measure_sizes(comm: Any, impl: Callable[[torch.Tensor], None], sizes: list[int], args: argparse.Namespace, record: dict[str, Any], world: int) -> None:
    name, round_ = record["impl"], record["round"]
    for nbytes in sizes:
        seconds, error = measure(comm, impl, nbytes, args.warmup, args.iters)
        size = max(nbytes // 4, 1) * 4
        record["results"].append({"bytes": size, "time_us": seconds * 1e6, "max_error": error})
        if comm.Get_rank() == 0:
            algbw, busbw = bus_bandwidth(size, seconds, world)
            print(f"round {round_}  {size:>11d} B  {name:<13s} {seconds * 1e6:>10.1f} us  busbw {busbw:7.3f} GB/s  err {error:.1e}", flush=True)


# --- driving: one launch per implementation, interleaved rounds ---------------------------------


def rotated(names: list[str], round_: int) -> list[str]:
    """Round k starts k places further on, so no implementation always runs first or last."""
    shift = round_ % len(names) if names else 0
    return names[shift:] + names[:shift]


def launch_argv(args: argparse.Namespace, name: str, round_: int, raw: Path) -> list[str]:
    argv = ["-b", str(args.begin), "-e", str(args.end), "-f", str(args.factor), "-w", str(args.warmup), "-n", str(args.iters)]
    argv += ["--algos", name, "--rounds", "1", "--first-round", str(round_), "--raw", str(raw), "--tuning-cache", args.tuning_cache or ""]
    return argv + (["--ranks-per-node", str(args.ranks_per_node)] if args.ranks_per_node else [])


def drive(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """Every implementation in a launch of its own, round after round; None if a launch failed."""
    mpirun = find_mpirun()
    if mpirun is None:
        print("error: mpirun not found (scripts/install.sh)", file=sys.stderr)
        return None
    env = local_ranks_environment(os.environ)
    launches: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        for round_ in range(args.rounds):
            for name in rotated(args.algos, round_):
                raw = Path(scratch) / f"{name}-{round_}.json"
                program = [sys.executable, "-m", "collectives.bench", *launch_argv(args, name, round_, raw)]
                done = subprocess.run(mpirun_command(args.np_, program, mpirun=mpirun), env=env)
                if done.returncode != 0 or not raw.exists():
                    print(f"error: the {name} launch of round {round_} failed (exit {done.returncode})", file=sys.stderr)
                    return None
                launches += json.loads(raw.read_text())
    return launches


def write_reports(launches: list[dict[str, Any]], args: argparse.Namespace, argv: list[str], world: int, hosts: list[str], mpi_library: str) -> None:
    summary = bench_report.summarize(launches, world)
    auto = next((launch for launch in launches if launch["impl"] == "auto" and "choices" in launch), None)
    meta = {
        "world_size": world,
        "hosts": ", ".join(hosts),
        "date": date.today().isoformat(),
        "command": "python -m collectives.bench " + " ".join(argv),
        "cpu_count": os.cpu_count(),
        "mpi": mpi_library,
        "torch": torch.__version__,
        "rounds": args.rounds,
        "layout": "one launch per implementation" if args.np_ else "all in one launch",
        "not_run": sorted({launch["impl"] for launch in launches if launch.get("skipped")}),
        "auto_tuning": f"measured in {auto['tuned_in_s']:.2f} s on these ranks" if auto else "",
        "auto_choices": auto["choices"] if auto else "",
        "ring_beats_rhd_from_bytes": bench_report.crossover(summary["rows"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps({"meta": meta, "summary": summary, "launches": launches}, indent=1) + "\n")
    text = bench_report.render_markdown(summary, meta)
    (args.out / "bench.md").write_text(text)
    plotted = bench_report.plot(summary, meta, args.out / "bench.png")
    print(text)
    print(f"bench: wrote {args.out}/bench.json, bench.md{', bench.png' if plotted else ' (no plot: pip install matplotlib)'}")


def under_mpi_launcher(env: Mapping[str, str]) -> bool:
    """Started as one of several MPI ranks (mpirun, or srun --mpi=pmix), not alone. The bench's
    own check, made before MPI starts (collectives/ reads no other launcher variable)."""
    sizes = (env.get(key, "") for key in ("OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE"))
    return any(size.isdigit() and int(size) > 1 for size in sizes)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m collectives.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-b", "--begin", type=parse_size, default=parse_size("8"), help="smallest size per rank (8, 64K, 16M)")
    parser.add_argument("-e", "--end", type=parse_size, default=parse_size("64M"), help="largest size per rank")
    parser.add_argument("-f", "--factor", type=int, default=2, help="size multiplier between steps")
    parser.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations per size")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each runs every implementation once)")
    parser.add_argument("--algos", type=lambda s: s.split(","), default=list(IMPLEMENTATIONS), help=f"comma list of {','.join(IMPLEMENTATIONS)}")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="group ranks into nodes (hierarchical)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for bench.json/.md/.png")
    parser.add_argument("--np", dest="np_", type=int, default=None, help="start this many ranks under mpirun, one launch per implementation")
    parser.add_argument("--tuning-cache", default=None, help="auto's tuning cache (default: none, auto is tuned afresh by this run)")
    parser.add_argument("--raw", type=Path, default=None, help=argparse.SUPPRESS)  # a launch's records, for the driver
    parser.add_argument("--first-round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.algos) - set(IMPLEMENTATIONS))
    if unknown:
        parser.error(f"unknown --algos {', '.join(unknown)}; choose from {', '.join(IMPLEMENTATIONS)}")
    if args.warmup < 0 or args.iters < 1 or args.rounds < 1:
        parser.error("-w must be >= 0, -n >= 1 and --rounds >= 1")
    if args.np_ is not None and args.np_ < 1:
        parser.error("--np must be >= 1")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        parser.error("--ranks-per-node must be >= 1")
    if args.np_ and args.ranks_per_node and args.np_ % args.ranks_per_node:
        parser.error(f"--ranks-per-node {args.ranks_per_node} does not divide --np {args.np_}")
    try:
        sizes_between(args.begin, args.end, args.factor)
    except ValueError as err:
        parser.error(str(err))
    if not args.ranks_per_node and "hierarchical" in args.algos and args.algos != ["hierarchical"]:
        args.algos = [name for name in args.algos if name != "hierarchical"]  # nothing to group
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.np_ and args.np_ > 1 and not under_mpi_launcher(os.environ):
        # Decided before MPI starts: a singleton MPI process would spin beside the ranks.
        if args.tuning_cache is None:
            with tempfile.TemporaryDirectory(prefix="bench-tuning-") as fresh:
                args.tuning_cache = fresh
                launches = drive(args)
        else:
            launches = drive(args)
        if launches is None:
            return 1
        write_reports(launches, args, argv, args.np_, [socket.gethostname()], _mpi_library_name())
        return 0
    from mpi4py import MPI

    from collectives.mpi import mpi_library

    comm = MPI.COMM_WORLD
    if args.ranks_per_node and comm.Get_size() % args.ranks_per_node:
        if comm.Get_rank() == 0:
            print(f"error: --ranks-per-node {args.ranks_per_node} does not divide {comm.Get_size()} ranks", file=sys.stderr)
        return 2
    if "horovod" in args.algos and len(args.algos) > 1 and args.raw is None and comm.Get_rank() == 0:
        print("bench: warning: Horovod's background thread slows whatever shares its process; use --np for one launch each", file=sys.stderr)
    launches = []
    for round_ in range(args.first_round, args.first_round + args.rounds):
        launches += run_launch(args, rotated(args.algos, round_), round_)
    all_hosts = comm.gather(socket.gethostname(), root=0)  # collective: before ranks > 0 leave
    if comm.Get_rank() != 0:
        return 0
    if args.raw is not None:
        args.raw.write_text(json.dumps(launches))
        return 0
    write_reports(launches, args, argv, comm.Get_size(), sorted(set(all_hosts or [])), mpi_library())
    return 0


def _mpi_library_name() -> str:
    """The MPI library's name without starting MPI in the driver (ompi_info, or 'unknown')."""
    try:
        done = subprocess.run(["ompi_info", "--version"], capture_output=True, text=True, timeout=10)
        return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
