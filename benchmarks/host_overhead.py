"""The built-in loop's cost on the host, on the CPU: a proxy for what it takes from a GPU, run on
every change (CI runs it through tests/unit/test_host_overhead.py).

    python -m benchmarks.host_overhead [--steps 300] [--warmup 30] [--rounds 3] [--write docs/benchmarks.md]

Two loops train the same tiny model (the built-in MLP on the digits, batch 8) in this process,
one after the other in each round: the built-in loop (trainers.loop.fit on one rank: the task, the
data read ahead, the step's sums, the reports) and a raw loop (forward, loss, backward, the same
optimizer and learning-rate schedule; its batches already decoded in memory). Printed, as one JSON line:

- `host_reads_per_step`: the reads of a tensor's value on the host in a step of the built-in
  loop (`.item()`, `.tolist()`, `float()`, `bool()`, `int()` of a tensor, `.cpu()`, `.numpy()`),
  counted by a torch function mode. On a GPU each is a wait for the device: the target is 1 (the
  step's sums), and the raw loop's count is printed beside it.
- `overhead_us_per_step`: the built-in loop's time per step minus the raw loop's (medians over
  the rounds of each loop's median step time): the host work a GPU job pays per step on top of a
  loop that does nothing but train. The target is 150 us.

The built-in loop's step times are the intervals between its step reports after `--warmup`
steps (a steady stream: no checkpoints, no evaluation in between); the raw loop's are timed the
same way, per step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

HOST_READS = frozenset({"item", "tolist", "__float__", "__bool__", "__int__", "__index__", "cpu", "numpy"})
TARGETS = {"host_reads_per_step": 1.0, "overhead_us_per_step": 150.0}


class HostReads(TorchFunctionMode):
    """Counts, while active, every call that reads a tensor's value on the host (on a GPU: a wait
    for the device). Calls from any thread of the process in which it is entered count only on
    that thread (torch function modes are per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting() -> Iterator[HostReads]:
    mode = HostReads()
    with mode:
        yield mode


def builtin_loop(steps: int, workdir: Path, reads: HostReads) -> list[tuple[float, int]]:
    """trainers.loop.fit for `steps` steps on one rank; (time, reads so far) at each step's report."""
    from collectives.base import SingleProcess
    from trainers.context import RunContext
    from trainers.loop.fit import fit
    from trainers.reporting.reporter import StepReporter

    marks: list[tuple[float, int]] = []

    class Marking(StepReporter):
        def report(self, record: dict[str, Any]) -> None:
            super().report(record)
            marks.append((time.thread_time(), reads.total))

    cfg = proxy_config(steps)
    run = RunContext(checkpoint_dir=workdir / "checkpoints", steps=Marking(workdir / "steps.jsonl"))
    fit(cfg, SingleProcess(), proxy_task(cfg), run)
    return marks


def proxy_config(steps: int) -> Any:
    """One epoch of the digits (1,437 samples: 179 steps of 8), cut at `steps`; no checkpoints."""
    from collectives.config import CommConfig
    from trainers.config import CheckpointConfig, DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from trainers.context import FitConfig

    return FitConfig(
        model=ModelConfig(hidden_sizes=[64]),
        data=DataConfig(batch_size=8),
        optim=OptimConfig(),
        trainer=dataclasses.replace(TrainerConfig(), epochs=1, max_steps=steps, watchdog_s=None, straggler_every=0),
        comm=CommConfig(),
        checkpoint=CheckpointConfig(every_steps=0, every_minutes=None),
    )


def proxy_task(cfg: Any) -> Any:
    """The built-in classification task on the built-in digits (converted once to HDF5)."""
    from trainers.data.datasets import resolve_data_path
    from trainers.tasks import build_task

    return build_task({}, {"model": cfg.model, "data": cfg.data, "trainer": cfg.trainer, "data_path": resolve_data_path(cfg.data)})


def raw_loop(steps: int, reads: HostReads) -> list[tuple[float, int]]:
    """The same model, optimizer, learning-rate schedule and batch size in a plain loop, its
    batches decoded beforehand; (time, reads so far) after each step."""
    from trainers.optim import build_optimizer, build_schedule

    cfg = proxy_config(steps)
    task = proxy_task(cfg)
    torch.manual_seed(cfg.trainer.seed)
    model = task.build_model()
    optimizer = build_optimizer(cfg.optim, model.parameters())
    schedule = build_schedule(cfg.optim, optimizer, steps)  # the user's training choice (cosine by default), not the toolkit's cost
    data = task.train_data()
    batch = cfg.data.batch_size
    count = min(len(data) // batch, steps)
    batches = [data.read(range(i * batch, (i + 1) * batch)) for i in range(count)]
    marks: list[tuple[float, int]] = []
    for step in range(steps):
        x, y = batches[step % count]
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        marks.append((time.thread_time(), reads.total))
    return marks


def per_step(marks: list[tuple[float, int]], warmup: int) -> tuple[float, float]:
    """(median seconds per step, mean reads per step) over the marks after `warmup`, but the last
    (the built-in loop reads the last two steps' sums together, after the last step)."""
    steady = marks[warmup:-1]
    if len(steady) < 3:
        raise SystemExit(f"host_overhead: {len(marks)} steps timed, {warmup} of them warm-up: give --steps more than --warmup + 2")
    intervals = [b[0] - a[0] for a, b in zip(steady, steady[1:], strict=False)]
    return statistics.median(intervals), (steady[-1][1] - steady[0][1]) / (len(steady) - 1)


def measure(steps: int = 300, warmup: int = 30, rounds: int = 3) -> dict[str, Any]:
    """Both loops, interleaved over `rounds` (which goes first alternates), timed without the
    counting mode (its own cost is per torch call); then each once more, counting its reads."""
    torch.set_num_threads(1)  # a rank's share of a node's cores, and steadier timings
    times: dict[str, list[float]] = {"builtin": [], "raw": []}
    reads: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:

        def run(which: str, index: int, counter: HostReads) -> list[tuple[float, int]]:
            return builtin_loop(steps, Path(tmp) / f"run-{index}", counter) if which == "builtin" else raw_loop(steps, counter)

        for round_no in range(rounds):
            for which in ("builtin", "raw") if round_no % 2 == 0 else ("raw", "builtin"):
                times[which].append(per_step(run(which, round_no, HostReads()), warmup)[0])
        kinds: Counter[str] = Counter()
        for which in ("builtin", "raw"):
            with counting() as counter:
                reads[which] = per_step(run(which, rounds, counter), warmup)[1]
            if which == "builtin":
                kinds = counter.counts
    loop, raw = statistics.median(times["builtin"]), statistics.median(times["raw"])
    overhead = 1e6 * (loop - raw)
    return {
        "host_reads_per_step": reads["builtin"],
        "raw_host_reads_per_step": reads["raw"],
        "overhead_us_per_step": round(overhead, 1),
        "loop_us_per_step": round(1e6 * loop, 1),
        "raw_us_per_step": round(1e6 * raw, 1),
        "overhead_us_spread": [round(1e6 * (a - b), 1) for a, b in zip(times["builtin"], times["raw"], strict=True)],
        "reads_by_kind": dict(sorted(kinds.items())),  # over a whole run: start-up and the final evaluation too
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "targets": TARGETS,
        "met": {"host_reads_per_step": reads["builtin"] <= TARGETS["host_reads_per_step"], "overhead_us_per_step": overhead <= TARGETS["overhead_us_per_step"]},
    }


def write(figures: dict[str, Any], path: Path) -> None:
    rounds = ", ".join(f"{v:.0f}" for v in figures["overhead_us_spread"])
    command = f"python -m benchmarks.host_overhead --steps {figures['steps']} --warmup {figures['warmup']} --rounds {figures['rounds']} --write {path}"
    lines = [
        "",
        f"### Host overhead of the built-in loop (CPU proxy), {date.today().isoformat()}",
        "",
        f"`{command}` on {platform.node()} ({platform.machine()}, {platform.python_version()}, torch {torch.__version__}).",
        "",
        "| figure | built-in loop | raw loop | target |",
        "| --- | --- | --- | --- |",
        f"| host reads per step | {figures['host_reads_per_step']:.2f} | {figures['raw_host_reads_per_step']:.2f} | <= {TARGETS['host_reads_per_step']:.0f} |",
        f"| us per step (median of round medians) | {figures['loop_us_per_step']:.1f} | {figures['raw_us_per_step']:.1f} | |",
        f"| overhead us per step | {figures['overhead_us_per_step']:.1f} (rounds: {rounds}) | | <= {TARGETS['overhead_us_per_step']:.0f} |",
        "",
    ]
    with path.open("a") as out:
        out.write("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", type=Path, help="append the figures to this markdown file")
    args = parser.parse_args(argv)
    figures = measure(args.steps, args.warmup, args.rounds)
    print(json.dumps(figures), flush=True)
    if args.write:
        write(figures, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
