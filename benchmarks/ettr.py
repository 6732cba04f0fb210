"""The effective training time ratio (ETTR) at 1,024 to 32,768 GPUs, projected from the measured
cost of a failure, the checkpoint's save cost and a failure process.

    python -m benchmarks.ettr [--png docs/img/ettr.png] [--spare-s S] [--requeue-s S] ...

The model (first order, as Young's and Daly's): training runs in intervals of tau seconds of work,
each followed by a save that blocks training for C seconds. Failures arrive at random (Poisson)
with a mean time between failures M(N) for the job at N GPUs; each costs the restart R (kill ->
first resumed step) and, on average, half an interval of work redone:

    ETTR(tau) = tau / (tau + C) * (1 - (R + (tau + C) / 2) / M(N))

tau is chosen to maximise it (numerically; Young's sqrt(2 C M) is printed beside it). The failure
process is Llama 3's (Meta, 2024): 419 unexpected interruptions in 54 days on 16,384 GPUs, one per
~3.1 hours, taken as proportional to the GPU count (M(N) = 3.1 h x 16,384 / N). Left out, as
Llama 3's and ByteRobust's figures leave out: planned maintenance, preemptions, and slowdowns
that are no failure. Paths compared (R):
- spare:   a lost node replaced by a spare inside the allocation (benchmarks/spare_node.py);
- requeue: the job requeued, plus Slurm's requeue hold (2 min by default) and no queue wait;
- before:  the spare path as measured on 2026-11-25 (29.7 s), before detection by exit.
R is what the simulated Slurm (2 nodes x 2 ranks) measured; at thousands of GPUs start-up
(rendezvous, NCCL's communicators) grows: a second table (and the plot's dashed lines) add
`--scale-up-s` (60 s by default; 0: none) to every path.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

GPU_COUNTS = (1024, 2048, 4096, 8192, 16384, 32768)
# Llama 3 (The Llama 3 Herd of Models, section 3.3.4): 419 unexpected interruptions in 54 days, 16,384 GPUs.
LLAMA3_GPUS, LLAMA3_INTERRUPTIONS, LLAMA3_DAYS = 16384, 419, 54
YARDSTICKS = (("Llama 3 (> 0.90)", 0.90), ("ByteRobust (0.97)", 0.97))


@dataclass(frozen=True)
class Path_:
    name: str
    restart_s: float


def mtbf_s(gpus: int) -> float:
    """The job's mean time between failures at `gpus`, Llama 3's rate scaled with the GPU count."""
    per_gpu_hour = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)
    return 3600.0 / (per_gpu_hour * gpus)


def ettr(interval_s: float, save_s: float, restart_s: float, mtbf: float) -> float:
    """The fraction of wall time that trains, for checkpoints every `interval_s` of work."""
    lost_per_failure = restart_s + (interval_s + save_s) / 2
    return max(0.0, interval_s / (interval_s + save_s) * (1 - lost_per_failure / mtbf))


def best_interval(save_s: float, restart_s: float, mtbf: float) -> tuple[float, float]:
    """(interval, ETTR) at the interval that maximises ETTR: a log-spaced search, refined once."""
    grid = [10 ** (k / 200) for k in range(0, 1001)]  # 1 s to 100,000 s
    best = max(grid, key=lambda tau: ettr(tau, save_s, restart_s, mtbf))
    fine = [best * 10 ** (k / 20000) for k in range(-100, 101)]
    best = max(fine, key=lambda tau: ettr(tau, save_s, restart_s, mtbf))
    return best, ettr(best, save_s, restart_s, mtbf)


def young_s(save_s: float, mtbf: float) -> float:
    return math.sqrt(2 * save_s * mtbf)


def table(paths: list[Path_], save_s: float, scale_up_s: float) -> list[str]:
    """A Markdown table: per GPU count, the job's MTBF and, per path, the best interval and its ETTR."""
    head = "| GPUs | MTBF | " + " | ".join(f"{p.name} (R {p.restart_s + scale_up_s:.0f} s): interval, ETTR" for p in paths) + " |"
    lines = [head, "|---:|---:|" + "---:|" * len(paths)]
    for gpus in GPU_COUNTS:
        mtbf = mtbf_s(gpus)
        cells = []
        for path in paths:
            interval, ratio = best_interval(save_s, path.restart_s + scale_up_s, mtbf)
            cells.append(f"{interval / 60:.1f} min (Young {young_s(save_s, mtbf) / 60:.1f}), **{ratio:.4f}**")
        lines.append(f"| {gpus:,} | {mtbf / 3600:.2f} h | " + " | ".join(cells) + " |")
    return lines


def plot(paths: list[Path_], save_s: float, scale_up_s: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    counts = [2**k for k in range(10, 16)]
    for colour, path in zip(("tab:blue", "tab:red", "tab:grey"), paths, strict=False):
        for extra, style in ((0.0, "-"), (scale_up_s, "--")) if scale_up_s else ((0.0, "-"),):
            ratios = [best_interval(save_s, path.restart_s + extra, mtbf_s(n))[1] for n in counts]
            label = f"{path.name} (R {path.restart_s + extra:.0f} s)"
            axes.plot(counts, ratios, style, color=colour, marker="o", label=label)
    for name, level in YARDSTICKS:
        axes.axhline(level, color="black", linewidth=0.8, linestyle=":")
        axes.text(counts[-1], level + 0.002, name, fontsize=8, horizontalalignment="right")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("GPUs (failures: Llama 3's rate, one per 3.1 h at 16,384)")
    axes.set_ylabel("ETTR at the best checkpoint interval")
    axes.set_title(f"Projected ETTR, save blocking {save_s:g} s (dashed: {scale_up_s:g} s more start-up at scale)")
    axes.legend(fontsize=8, loc="lower left")
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ettr", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spare-s", type=float, default=1.9, help="kill -> first resumed step, spare path, warm ranks (measured 2026-12-02, s)")
    parser.add_argument("--requeue-s", type=float, default=47.9, help="kill -> first resumed step, requeue path, hold excluded (measured 2026-12-02, s)")
    parser.add_argument("--hold-s", type=float, default=120.0, help="Slurm's requeue hold added to the requeue path (s)")
    parser.add_argument("--before-s", type=float, default=29.7, help="the spare path before detection by exit (2026-11-25, s)")
    parser.add_argument("--save-s", type=float, default=1.0, help="what a checkpoint save blocks training for (s)")
    parser.add_argument("--scale-up-s", type=float, default=60.0, help="start-up added at thousands of GPUs, second table (s)")
    parser.add_argument("--png", type=Path, default=None, help="write the plot here")
    args = parser.parse_args(argv)
    paths = [Path_("spare", args.spare_s), Path_("requeue", args.requeue_s + args.hold_s), Path_("before", args.before_s)]
    print(f"save blocks {args.save_s:g} s; failures: one per {mtbf_s(LLAMA3_GPUS) / 3600:.2f} h at {LLAMA3_GPUS:,} GPUs, scaled with the count")
    print("\n".join(table(paths, args.save_s, 0.0)))
    if args.scale_up_s:
        print(f"\nwith {args.scale_up_s:g} s more start-up per restart at scale:")
        print("\n".join(table(paths, args.save_s, args.scale_up_s)))
    if args.png is not None:
        plot(paths, args.save_s, args.scale_up_s, args.png)
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
