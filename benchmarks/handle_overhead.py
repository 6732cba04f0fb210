"""The run handle's per-step cost: one DDP script, with and without `run.end_step(loss=...)`.

    python benchmarks/handle_overhead.py [--ranks 2] [--repeats 5] [--steps 150] [--width 640] [--write docs/benchmarks.md]

Both variants are the same torchrun-style script (gloo DDP, an MLP whose step takes about 20 ms
on this machine at the default width), started by `torch.distributed.run` on the same ranks,
interleaved (which goes first alternates). Each times its steps after a warm-up inside the
script, so process start and the handle's start-up (restore, registry check) are not counted;
the handle's checkpoints are left to their default timing (every 10 minutes: none in a run).
Without the handle the script does what a plain loop does per step: nothing beyond the step.
With it: one allreduce of a few numbers (the loss, the stop vote, the save handshake) and one
host sync to read them, the handle's whole cost.
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

ROOT = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    """One rank of one variant (under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(args.width, args.width), nn.ReLU())], nn.Linear(args.width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    run = None
    if args.handle:
        from hpc.run import start_run

        run = start_run(args.run_dir, model=model, optimizer=optimizer)
    ddp = DistributedDataParallel(model)
    x = torch.randn(64, args.width, generator=torch.Generator().manual_seed(rank))
    began = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            began = time.perf_counter()
        loss = ddp(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if run is not None and run.end_step(loss=loss):
            break
    dist.barrier()
    seconds = time.perf_counter() - began
    if run is not None:
        run.finish()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"steps_per_s": args.steps / seconds, "step_ms": 1000 * seconds / args.steps}))
    dist.destroy_process_group()


def one_run(handle: bool, args: argparse.Namespace, tmp: Path, index: int) -> dict[str, float]:
    out = tmp / f"run-{index}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks), str(Path(__file__).resolve()), "--worker"]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width), "--out", str(out), "--run-dir", str(tmp / f"dir-{index}")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*command, *(["--handle"] if handle else [])], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"a run failed (exit {done.returncode}): {done.stderr[-1500:]}")
    return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--width", type=int, default=640, help="the MLP's width: sets the step time")
    parser.add_argument("--write", type=Path, help="append the figures to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--handle", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    plain: list[dict[str, float]] = []
    handled: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            for handle in order:
                figures = one_run(handle, args, Path(tmp), 2 * repeat + handle)
                (handled if handle else plain).append(figures)
                variant = "with" if handle else "without"
                print(f"repeat {repeat + 1}: {variant} the handle {figures['steps_per_s']:.2f} steps/s ({figures['step_ms']:.1f} ms/step)", flush=True)
    ratios = [h["steps_per_s"] / p["steps_per_s"] for h, p in zip(handled, plain, strict=True)]
    rates_plain, rates_handled = (", ".join(f"{r['steps_per_s']:.2f}" for r in runs) for runs in (plain, handled))
    median_plain, median_handled = statistics.median(p["step_ms"] for p in plain), statistics.median(h["step_ms"] for h in handled)
    lines = [
        f"### The run handle's per-step cost ({date.today()}, {platform.node()}, {platform.machine()}, {os.cpu_count()} cores)",
        "",
        f"`python benchmarks/handle_overhead.py --ranks {args.ranks} --repeats {args.repeats} --steps {args.steps} --width {args.width}`: "
        f"{args.ranks} ranks under torchrun, gloo DDP, {args.steps} timed steps after {args.warmup}, interleaved.",
        "",
        "| | step ms (median) | steps/s per repeat |",
        "|---|---|---|",
        f"| without the handle | {median_plain:.1f} | {rates_plain} |",
        f"| with `run.end_step(loss=loss)` | {median_handled:.1f} | {rates_handled} |",
        "",
        f"With / without, per repeat: {', '.join(f'{r:.3f}' for r in ratios)}; median **{statistics.median(ratios):.3f}x** (goal >= 0.97x).",
        "",
    ]
    print("\n".join(lines))
    if args.write:
        with args.write.open("a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
