"""task=lm through the toolkit against a plain hand-written training loop of the same model,
batch and context, on the same ranks, in one run (variants interleaved, repeated).

    python benchmarks/lm_throughput.py [--ranks 2] [--steps 60] [--repeats 3] [--write docs/benchmarks.md]

Variants, each `--steps` optimizer steps of the GPT-style model on the embedded corpus:
  toolkit, comm=gloo          fit() with the lm task; gradients by DistributedDataParallel over Gloo
  plain loop, DDP over Gloo   the same model, AdamW and batches in a bare loop (zero_grad, forward,
                              backward, step), DistributedDataParallel over Gloo
  toolkit, comm=mpi           fit() with our allreduce engine (fusion buckets, overlap)
  plain loop, our optimizer   the bare loop with our distributed optimizer wrapper on MPI
Reported: tokens/s (rank 0's wall clock over the steps after `--warmup`, for both the same way),
the toolkit/plain ratio per backend (the median of the per-repeat ratios; toolkit and plain loop
alternate which runs first), and the loss after `--steps` steps on 1 rank and on R ranks at the
same global batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TASK = {"context": 64, "layers": 2, "heads": 4, "width": 128}
BATCH = 32  # per rank


def fit_config(steps: int, batch: int, backend: str) -> Any:
    from collectives.config import CommConfig
    from trainers.config import CheckpointConfig, DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from trainers.context import FitConfig

    trainer = dataclasses.replace(TrainerConfig(), epochs=1, max_steps=steps, watchdog_s=None, log_every=10**6)
    return FitConfig(
        model=ModelConfig(),
        data=DataConfig(batch_size=batch, eval_batch_size=256),
        optim=OptimConfig(name="adamw", lr=0.002, weight_decay=0.01),
        trainer=trainer,
        comm=CommConfig(backend=backend),
        checkpoint=CheckpointConfig(enabled=False),
    )


def toolkit_run(comm: Any, backend: str, steps: int, warmup: int, batch: int, tokens: Path) -> tuple[float, float]:
    """(wall seconds from the end of step `warmup` to the end of the last step, the last step's
    loss), on rank 0: measured as the plain loop is, by the clock, not from the step records."""
    from trainers.context import RunContext
    from trainers.loop.fit import fit
    from trainers.reporting.reporter import StepReporter
    from trainers.tasks.lm import LanguageModelTask

    class Clocked(StepReporter):
        """Notes when each step is reported (rank 0 reports every step, after it ends)."""

        def __init__(self) -> None:
            super().__init__(None)
            self.ended: dict[int, float] = {}
            self.loss = 0.0

        def report(self, record: dict[str, Any]) -> None:
            self.ended[int(record["step"])] = time.perf_counter()
            self.loss = float(record["loss"])

    clock = Clocked()
    task = LanguageModelTask(tokens=str(tokens), **TASK)
    fit(fit_config(steps, batch, backend), comm, task, RunContext(steps=clock))
    if comm.rank != 0:
        return 0.0, 0.0
    return clock.ended[steps] - clock.ended[warmup], clock.loss


def plain_run(comm: Any, backend: str, steps: int, warmup: int, batch: int, tokens: Path) -> float:
    """The bare loop; seconds for the steps after warm-up, on rank 0."""
    import torch

    from collectives.base import broadcast_module
    from collectives.config import CommConfig
    from collectives.optimizer import apply_distributed_optimizer
    from trainers.data.sampler import ShardSampler
    from trainers.data.tokens import VOCAB_SIZE, TokenWindows
    from trainers.gpt import GPT, GPTShape, next_token_loss

    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=VOCAB_SIZE, **TASK))
    broadcast_module(comm, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=0.01)
    if backend == "gloo":
        module: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        module = model
        optimizer = apply_distributed_optimizer(optimizer, model, comm, CommConfig(), 1)
    windows = TokenWindows(tokens, "train", TASK["context"])
    sampler = ShardSampler(len(windows), batch, comm.rank, comm.world_size, 0)
    started = 0.0
    for step, indices in enumerate(sampler.batches(1), start=1):
        if step == warmup + 1:
            started = time.perf_counter()
        items = windows.__getitems__(indices.tolist())
        x, y = torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items])
        optimizer.zero_grad()
        next_token_loss(module(x), y).backward()
        optimizer.step()
        if step == steps:
            break
    comm.barrier()
    return time.perf_counter() - started


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    from collectives import init_collectives
    from collectives.base import SingleProcess
    from collectives.config import CommConfig
    from hpc.env import RankInfo
    from trainers.data.tokens import embedded_token_path

    torch.set_num_threads(1)
    place = RankInfo.from_env(os.environ)
    tokens = embedded_token_path() if place.rank == 0 else None
    tokens = Path(MPI.COMM_WORLD.bcast(str(tokens) if tokens else None, root=0))
    port = None
    if place.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    meet = ("127.0.0.1", int(MPI.COMM_WORLD.bcast(port, root=0)))
    comms = {"gloo": init_collectives(CommConfig(backend="gloo"), place, rendezvous=meet), "mpi": init_collectives(CommConfig(), place)}
    seconds: dict[str, list[float]] = {}
    losses: dict[str, float] = {}
    for repeat in range(args.repeats):
        for backend in ("gloo", "mpi"):
            toolkit_first = repeat % 2 == 0  # ABBA: neither variant always runs on a warmer machine
            for variant in ("toolkit", "plain") if toolkit_first else ("plain", "toolkit"):
                if variant == "toolkit":
                    spent, loss = toolkit_run(comms[backend], backend, args.steps, args.warmup, BATCH, tokens)
                    seconds.setdefault(f"toolkit, comm={backend}", []).append(spent)
                    losses[f"{place.world_size} ranks, comm={backend}"] = loss
                else:
                    plain = plain_run(comms[backend], backend, args.steps, args.warmup, BATCH, tokens)
                    seconds.setdefault(f"plain loop, {'DDP over Gloo' if backend == 'gloo' else 'our optimizer (mpi)'}", []).append(plain)
    if place.rank == 0:  # the same global batch on one rank
        _, losses["1 rank"] = toolkit_run(SingleProcess(), "mpi", args.steps, args.warmup, BATCH * place.world_size, tokens)
    MPI.COMM_WORLD.Barrier()
    for comm in comms.values():
        comm.close()
    if place.rank == 0:
        print("RESULT " + json.dumps({"seconds": seconds, "losses": losses, "world_size": place.world_size}))


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    tokens_per_step = BATCH * result["world_size"] * TASK["context"]
    timed_steps = args.steps - args.warmup
    rate = {name: [tokens_per_step * timed_steps / s for s in spent] for name, spent in result["seconds"].items()}
    lines = ["| variant | tokens/s (median) | runs |", "| --- | ---: | --- |"]
    for name, rates in rate.items():
        lines.append(f"| {name} | {statistics.median(rates):,.0f} | {', '.join(f'{r:,.0f}' for r in rates)} |")
    pairs = [("toolkit, comm=gloo", "plain loop, DDP over Gloo"), ("toolkit, comm=mpi", "plain loop, our optimizer (mpi)")]
    lines.append("")
    for ours, plain in pairs:
        ratios = [a / b for a, b in zip(rate[ours], rate[plain], strict=True)]
        lines.append(f"- {ours} / {plain}: {statistics.median(ratios):.3f}x (per repeat: {', '.join(f'{r:.3f}' for r in ratios)})")
    losses = result["losses"]
    lines.append(
        f"- loss after {args.steps} steps at the global batch of {BATCH * result['world_size']}: " + ", ".join(f"{k} {v:.5f}" for k, v in losses.items())
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", type=Path, help="append the table to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be >= 0 and below --steps")
    if args.worker:
        worker(args)
        return
    from collectives.mpirun import local_ranks_environment, mpirun_command

    program = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
    ]
    env = {**local_ranks_environment(os.environ), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(mpirun_command(args.ranks, program), env=env, capture_output=True, text=True, cwd=ROOT)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        raise SystemExit(f"the ranks failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    text = report(json.loads(found[0].removeprefix("RESULT ")), args)
    print(text)
    if args.write:
        header = (
            f"\n### task=lm against a plain loop ({date.today().isoformat()}, {platform.node()}, {os.cpu_count()} cores)\n\n"
            f"`python benchmarks/lm_throughput.py --ranks {args.ranks} --steps {args.steps} --warmup {args.warmup} --repeats {args.repeats}` "
            f"(GPT {TASK}, batch {BATCH} per rank, AdamW; variants interleaved)\n\n"
        )
        with args.write.open("a") as f:
            f.write(header + text + "\n")


if __name__ == "__main__":
    main()
