"""Scaling of a plain training loop: our distributed optimizer against Horovod's
DistributedOptimizer and torch DDP (Gloo) on the same loop, each variant in a launch of its own,
in interleaved rounds.

    python benchmarks/plain_loop.py [--ranks 2] [--rounds 3] [--steps 60] [--hidden 1024] [--batch 64]

The loop: an MLP of about 3M parameters (1024 -> 1024 -> 1024 -> 1024 -> 10), one fixed batch
of 64 per rank (no data loading), SGD with momentum, one thread per rank. Weak scaling:
efficiency = samples/s of N ranks / (N x samples/s of 1 rank).

The bound: "nocomm" (N ranks, no communication) trains the same loop on N ranks that never talk. What it
loses against N x 1 rank is what the machine takes (memory bandwidth and caches shared by the
ranks, other tenants), not communication; no allreduce can scale better than it does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name: how gradients are averaged; every variant but "single" runs on --ranks ranks
    "single": "none",
    "nocomm": "none",
    "ours": "ours",
    "ours-nooverlap": "ours-nooverlap",
    "horovod": "horovod",
    "ddp": "ddp",
}
TITLES = {
    "single": "1 rank",
    "nocomm": "no communication (the bound)",
    "ours": "ours",
    "ours-nooverlap": "ours, comm.overlap=false",
    "horovod": "Horovod",
    "ddp": "DDP (Gloo)",
}


def variant_ranks(name: str, ranks: int) -> int:
    return 1 if name == "single" else ranks


def title(name: str, ranks: int) -> str:
    return TITLES[name] if name == "single" else f"{ranks} ranks, {TITLES[name]}"


# --- one launch -----------------------------------------------------------------------------------


def train(sync: str, steps: int, warmup: int, hidden: int, batch: int, out: Path) -> None:
    import torch
    from mpi4py import MPI
    from torch import nn

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1024), nn.ReLU(), nn.Linear(1024, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(comm.Get_rank())
    inputs, labels = torch.randn(batch, 1024, generator=generator), torch.randint(0, 10, (batch,), generator=generator)
    close = lambda: None  # noqa: E731
    if sync.startswith("ours"):
        from collectives.base import broadcast_module
        from collectives.config import CommConfig
        from collectives.mpi import MpiCollectives
        from collectives.optimizer import apply_distributed_optimizer
        from collectives.tuning import default_cache_dir

        engine = MpiCollectives.from_world("auto")
        engine.tune(default_cache_dir())
        broadcast_module(engine, model)
        optimizer = apply_distributed_optimizer(optimizer, model, engine, CommConfig(overlap=sync == "ours"))
        close = engine.close
    elif sync == "horovod":
        import horovod.torch as hvd

        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    elif sync == "ddp":
        import torch.distributed as dist

        from collectives.bench import _gloo

        _gloo(comm)
        model = nn.parallel.DistributedDataParallel(model)
        close = dist.destroy_process_group
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for step in range(warmup + steps):
        comm.Barrier() if step == warmup else None
        started = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(inputs), labels).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    per_step = statistics.median(times[warmup:])
    slowest = comm.allreduce(per_step, op=MPI.MAX)
    close()
    if comm.Get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        out.write_text(
            json.dumps({"step_s": slowest, "samples_s": comm.Get_size() * batch / slowest, "params": params, "loss": float(loss_fn(model(inputs), labels))})
        )


# --- the driver -----------------------------------------------------------------------------------


def launch(name: str, args: argparse.Namespace, scratch: Path, round_: int) -> dict[str, float]:
    from collectives.mpirun import local_ranks_environment, mpirun_command

    ranks, sync = variant_ranks(name, args.ranks), VARIANTS[name]
    out = scratch / f"{sync}-{ranks}-{round_}.json"
    program = [
        sys.executable,
        __file__,
        "--worker",
        sync,
        "--steps",
        str(args.steps),
        "--hidden",
        str(args.hidden),
        "--batch",
        str(args.batch),
        "--out",
        str(out),
    ]
    env = {**local_ranks_environment(os.environ), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(mpirun_command(ranks, program), env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"error: {name} failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
    return json.loads(out.read_text())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="ranks of every variant but single")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per launch (after 10 warm-up steps)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(f"{k} ({v})" for k, v in TITLES.items()))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        sys.path.insert(0, str(ROOT))
        train(args.worker, args.steps, 10, args.hidden, args.batch, args.out)
        return 0
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or args.rounds < 1 or args.steps < 1 or args.ranks < 2:
        parser.error(f"unknown variants {unknown}" if unknown else "--rounds and --steps must be >= 1, --ranks >= 2")
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        names = [n for n in names if VARIANTS[n] != "horovod"]
        print("plain_loop: Horovod does not import; its variant is left out", file=sys.stderr)
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="plain-loop-") as scratch:
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                results[name].append(launch(name, args, Path(scratch), round_))
                print(f"round {round_}  {title(name, args.ranks):<40s} {results[name][-1]['samples_s']:9.0f} samples/s", flush=True)
    single = [r["samples_s"] for r in results.get("single", [])]
    params = next(iter(results.values()))[0]["params"]
    print(f"\n{params / 1e6:.2f}M parameters, batch {args.batch} per rank, {args.steps} timed steps, median over {args.rounds} rounds\n")
    print(f"| variant | samples/s | step ms | efficiency (vs {args.ranks} x 1 rank, paired by round) |\n| --- | --- | --- | --- |")
    for name, rows in results.items():
        ranks = variant_ranks(name, args.ranks)
        samples = statistics.median(r["samples_s"] for r in rows)
        step_ms = statistics.median(r["step_s"] for r in rows) * 1e3
        cell = ""
        if single and ranks > 1:
            paired = [r["samples_s"] / (ranks * s) for r, s in zip(rows, single, strict=False)]
            cell = f"{statistics.median(paired):.2f} ({min(paired):.2f}-{max(paired):.2f})"
        print(f"| {title(name, args.ranks)} | {samples:,.0f} | {step_ms:.1f} | {cell} |")
    ours = results.get("ours")
    print()
    for other in ("horovod", "ddp", "nocomm"):
        if ours and results.get(other):
            paired = [a["samples_s"] / b["samples_s"] for a, b in zip(ours, results[other], strict=False)]
            print(f"ours / {TITLES[other]}: {statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
