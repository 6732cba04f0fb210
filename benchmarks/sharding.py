"""Per-rank memory and step rate of replicated training against ZeRO-1 and ZeRO-2 on our engine.

    python -m benchmarks.sharding [--ranks 2 4] [--layers 12] [--width 512] [--steps 6] [--repeats 2] [--write docs/benchmarks.md]

A GPT whose AdamW state dominates memory (about 38 M parameters at the defaults: 12 blocks of
width 512), a tiny batch (one sequence of 32 tokens per rank, so the step is the optimizer's and
the communication's), trained on random tokens by mpirun ranks for each comm.sharding mode,
modes interleaved per repeat. Each rank measures its resident set before building the model (once
an optimizer has stepped and a collective has run: the modules and buffers they bring are a
constant of the process) and its peak after the steps (getrusage): the difference is what
training holds (parameters,
gradients, optimizer state, buffers). The theory (ZeRO paper, table 1, for fp32 AdamW): 16 bytes
per parameter replicated (4 parameter + 4 gradient + 8 optimizer state); ZeRO-1 4 + 4 + 8/N;
ZeRO-2 4 + (4 + 8)/N. Step rates are the median of the timed steps after two warm-up steps.

glibc's allocator keeps freed heap memory in the process by default, so a resident-set peak shows
what was ever allocated at once or fragmented, not what is held: every mode's ranks run with
MALLOC_MMAP_THRESHOLD_=65536 (`--mmap-threshold`, 0 for glibc's default), which maps and unmaps
the tensors' memory, so freed buffers (FSDP2's gathered blocks above all) leave the resident set.
comm.sharding=full runs FSDP2 over gloo beside our engine (which only reports the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("none", "optimizer", "gradients", "full")


def status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def resident_mib() -> float:
    return status_mib("VmRSS")


def limit_memory(extra_mib: float) -> None:
    """Let this process's private writable memory (RLIMIT_DATA: heap and anonymous mappings, which
    is where tensors live) grow by `extra_mib` from now: a per-rank memory limit, as a cgroup or a
    cluster's per-task limit would set, that fails the allocation beyond it."""
    import resource

    limit = int((status_mib("VmData") + extra_mib) * 2**20)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def worker(args: argparse.Namespace) -> None:
    """One rank (under mpirun); a failure (out of memory) ends every rank, as the toolkit's do."""
    from collectives.mpi import MpiCollectives

    comm = MpiCollectives.from_world()
    try:
        train_one(args, comm)
    except BaseException as err:
        print(f"rank {comm.rank}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        comm.abort(1)
    comm.close()


def train_one(args: argparse.Namespace, comm: Any) -> None:
    """Build, shard per --mode, time the steps, report memory."""
    import torch
    from torch import nn

    from collectives.base import broadcast_module
    from collectives.config import CommConfig
    from collectives.optimizer import apply_distributed_optimizer
    from collectives.zero import STAGES, shard_optimizer
    from trainers.gpt import GPT, GPTShape
    from trainers.reporting.memory import peak_memory_mib

    torch.set_num_threads(1)
    if args.mode == "full":  # FSDP2 on torch.distributed gloo, beside the engine that reports the figures
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=comm.rank, world_size=comm.world_size)
    warm = nn.Linear(4, 4)  # the modules an optimizer's first step imports (torch._dynamo: ~70 MiB) count before, not per parameter
    warm_optimizer = torch.optim.AdamW(warm.parameters())
    warm(torch.ones(1, 4)).sum().backward()
    warm_optimizer.step()
    comm.allreduce_(torch.zeros(1 << 16))  # and the engine's first collective
    import torch.distributed.fsdp  # noqa: F401  # and FSDP2's modules, imported by every mode alike
    import torch.distributed.tensor  # noqa: F401

    before = resident_mib()
    if args.limit_mib:
        limit_memory(args.limit_mib)
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=256, context=args.context, layers=args.layers, heads=8, width=args.width))
    broadcast_module(comm, model)
    if args.mode == "full":
        from collectives.fsdp import shard_model

        shard_model(model, model.blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = CommConfig(sharding=args.mode)
    if args.mode == "full":
        pass  # FSDP2 reduce-scatters in backward and gathers in forward by itself
    elif args.mode == "none":
        apply_distributed_optimizer(optimizer, model, comm, cfg)
    else:
        shard_optimizer(optimizer, model, comm, cfg, STAGES[args.mode])
    generator = torch.Generator().manual_seed(comm.rank)
    times = []
    for step in range(args.steps + 2):
        tokens = torch.randint(0, 256, (1, args.context + 1), generator=generator)
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= 2:
            times.append(time.perf_counter() - started)
    params = sum(p.numel() for p in model.parameters())  # FSDP2's DTensors count their whole shape
    held = torch.tensor([peak_memory_mib(torch.device("cpu")) - before], dtype=torch.float64)
    everyone = comm.allgather(held).tolist()
    if comm.rank == 0:
        print(json.dumps({"mode": args.mode, "params": params, "held_mib": everyone, "step_s": statistics.median(times)}), flush=True)
    if args.mode == "full":
        import torch.distributed as dist

        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_mode(ranks: int, mode: str, args: argparse.Namespace, limit_mib: float = 0.0) -> dict[str, object]:
    from collectives.mpirun import mpirun_command, root_environment

    command = mpirun_command(ranks, [sys.executable, "-m", "benchmarks.sharding", "--worker", "--mode", mode, "--port", str(free_port())])
    command += ["--layers", str(args.layers), "--width", str(args.width), "--context", str(args.context), "--steps", str(args.steps)]
    command += ["--limit-mib", str(limit_mib)] if limit_mib else []
    env = {**os.environ, **root_environment(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if args.mmap_threshold:  # glibc: allocations from this size are mapped and unmapped, so freed memory leaves the resident set
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    done = subprocess.run(command, cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        if limit_mib:
            out_of_memory = "can't allocate memory" in done.stderr or "MemoryError" in done.stderr or "Cannot allocate memory" in done.stderr
            return {"mode": mode, "failed": "out of memory" if out_of_memory else done.stderr[-300:]}
        raise SystemExit(f"{mode} on {ranks} ranks failed: {done.stderr[-1500:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("{"))
    return dict(json.loads(line))


def theory_bytes(mode: str, ranks: int) -> float:
    return {"none": 16.0, "optimizer": 8 + 8 / ranks, "gradients": 4 + 12 / ranks, "full": 16 / ranks}[mode]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharding", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", default="none")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", type=Path, default=None)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mmap-threshold", type=int, default=65536, help="MALLOC_MMAP_THRESHOLD_ for every mode's ranks; 0: glibc's default")
    parser.add_argument("--limit-mib", type=float, default=0.0, help="worker: the per-rank memory limit above its start")
    parser.add_argument("--limit-demo-mib", type=float, default=0.0, help="also run every mode on 2 ranks under this per-rank limit")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    for ranks in args.ranks:
        results: dict[str, list[dict[str, object]]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                results[mode].append(run_mode(ranks, mode, args))
        base_rate = 1 / statistics.median(float(r["step_s"]) for r in results["none"])  # type: ignore[arg-type]
        for mode in MODES:
            params = int(results[mode][0]["params"])  # type: ignore[call-overload]
            held = max(max(r["held_mib"]) for r in results[mode])  # type: ignore[type-var, call-overload]
            rate = 1 / statistics.median(float(r["step_s"]) for r in results[mode])  # type: ignore[arg-type]
            rows.append((ranks, mode, params, held, held * 2**20 / params, theory_bytes(mode, ranks), rate, rate / base_rate))
            print(
                f"{ranks} ranks  {mode:9s}  {params / 1e6:.1f} M params  held {held:7.0f} MiB/rank = {held * 2**20 / params:5.1f} B/param "
                f"(theory {theory_bytes(mode, ranks):4.1f})  {rate:.2f} steps/s ({rate / base_rate:.2f}x replicated)",
                flush=True,
            )
    limited = []
    if args.limit_demo_mib:
        for mode in MODES:
            outcome = run_mode(2, mode, args, args.limit_demo_mib)
            said = outcome.get("failed") or f"trains ({max(outcome['held_mib']):.0f} MiB held)"  # type: ignore[call-overload]
            limited.append((mode, str(said)))
            print(f"2 ranks, {args.limit_demo_mib:.0f} MiB per rank: {mode:9s} {said}", flush=True)
    if args.write:
        write(args, rows, limited)
    return 0


def write(args: argparse.Namespace, rows: list[tuple[int, str, int, float, float, float, float, float]], limited: list[tuple[str, str]]) -> None:
    lines = [
        "",
        f"## Sharded data parallel on our engine: memory per rank and step rate ({date.today().isoformat()})",
        "",
        f"`python -m benchmarks.sharding --ranks {' '.join(map(str, args.ranks))} --layers {args.layers} --width {args.width} "
        f"--steps {args.steps} --repeats {args.repeats} --mmap-threshold {args.mmap_threshold}"
        + (f" --limit-demo-mib {args.limit_demo_mib:.0f}" if args.limit_demo_mib else "")
        + f"` on {platform.node() or 'this machine'} ({os.cpu_count()} cores), mpirun ranks, "
        "a GPT with AdamW (fp32), one 32-token sequence per rank, modes interleaved. *Held*: the rank's peak resident set minus "
        "its resident set before the model was built (max over ranks and repeats); theory: ZeRO paper table 1 for fp32 AdamW.",
        "",
        "| ranks | comm.sharding | parameters | held per rank | bytes/param | theory | steps/s | vs replicated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ranks, mode, params, held, per_param, theory, rate, ratio in rows:
        lines.append(f"| {ranks} | {mode} | {params / 1e6:.1f} M | {held:.0f} MiB | {per_param:.1f} | {theory:.1f} | {rate:.2f} | {ratio:.2f}x |")
    if limited:
        lines += ["", f"Under a per-rank memory limit of {args.limit_demo_mib:.0f} MiB above the rank's start (RLIMIT_DATA, `--limit-demo-mib`), 2 ranks:", ""]
        lines += [f"- comm.sharding={mode}: {said}" for mode, said in limited]
    with args.write.open("a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
