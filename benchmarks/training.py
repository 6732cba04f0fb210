"""Training-level figures: the same job under several settings, side by side in one run.

    python benchmarks/training.py SUITE [--repeats 3] [--write docs/benchmarks.md]

Suites:
  ranks        the embedded default on 1, 2 and 3 local ranks
  overlap      a wider MLP (communication-heavy) on 2 ranks: per-tensor vs fused allreduce,
               with and without overlap, against 1 rank (no communication at all)
  compression  the embedded default on 2 ranks with each gradient compression
  backends     a wider MLP on 2 ranks with each CPU backend (mpi, gloo, horovod when installed)
  scaling      weak scaling of the default model, 1, 2, 4, ... up to --max-ranks local ranks,
               for each CPU backend; efficiency = samples/s / (ranks x the 1-rank samples/s)

Variants run interleaved (A, B, C, A, B, C, ...) so machine noise hits all alike; reported are
medians of the per-epoch figures after the first epoch (which includes warm-up).
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
WIDE = ["model.hidden_sizes=[1024,1024,1024]", "trainer.epochs=4"]
EARLY_EPOCH = 3  # convergence speed shows early: the easy default data set ends alike

SUITES: dict[str, dict[str, list[str]]] = {
    "ranks": {
        "1 rank": ["resources.tasks_per_node=1"],
        "2 ranks": ["resources.tasks_per_node=2"],
        "3 ranks": ["resources.tasks_per_node=3"],
    },
    "overlap": {
        "1 rank, no communication": [*WIDE, "resources.tasks_per_node=1"],
        "2 ranks, per-tensor, no overlap": [*WIDE, "comm.bucket_mb=0", "comm.overlap=false"],
        "2 ranks, fused 4 MiB, no overlap": [*WIDE, "comm.bucket_mb=4", "comm.overlap=false"],
        "2 ranks, per-tensor, overlap": [*WIDE, "comm.bucket_mb=0", "comm.overlap=true"],
        "2 ranks, fused 4 MiB, overlap": [*WIDE, "comm.bucket_mb=4", "comm.overlap=true"],
    },
    "compression": {
        "none": ["comm.compression=none"],
        "fp16": ["comm.compression=fp16"],
        "bf16": ["comm.compression=bf16"],
        "topk 10%": ["comm.compression=topk", "comm.topk_ratio=0.1"],
        "topk 1%": ["comm.compression=topk", "comm.topk_ratio=0.01"],
    },
}


def backend_names() -> list[str]:
    import importlib.util

    return ["mpi", "gloo"] + (["horovod"] if importlib.util.find_spec("horovod") else [])


def scaling_suite(max_ranks: int) -> dict[str, list[str]]:
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_ranks]
    return {f"{backend}, {n} ranks": [f"comm={backend}", f"resources.tasks_per_node={n}", "trainer.epochs=4"] for backend in backend_names() for n in counts}


def efficiency_table(results: dict[str, list[dict[str, float]]]) -> str:
    rows = ["| backend | ranks | samples/s | weak-scaling efficiency |", "| --- | --- | --- | --- |"]
    single: dict[str, float] = {}
    for name, runs in results.items():
        backend, ranks = name.split(", ")[0], int(name.split(", ")[1].split()[0])
        sps = statistics.median(r["samples_per_s"] for r in runs)
        if ranks == 1:
            single[backend] = sps
        rows.append(f"| {backend} | {ranks} | {sps:,.0f} | {sps / (ranks * single[backend]):.2f} |")
    return "\n".join(rows)


def run_once(overrides: list[str], workdir: Path) -> dict[str, float]:
    run_root = workdir / f"run-{time.monotonic_ns()}"
    started = time.perf_counter()
    command = [sys.executable, str(ROOT / "launch.py"), *overrides, f"run_root={run_root}"]
    subprocess.run(command, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    (summary_path,) = run_root.glob("*/*/result.json")
    summary = json.loads(summary_path.read_text())
    all_epochs = [json.loads(line) for line in (summary_path.parent / "metrics.jsonl").read_text().splitlines()]
    early = all_epochs[min(EARLY_EPOCH, len(all_epochs)) - 1]
    epochs = all_epochs[1:]
    return {
        "early_loss": early["loss"],
        "early_accuracy": early["val_accuracy"],
        "accuracy": summary["val_metrics"]["accuracy"],
        "loss": summary["loss"],
        "samples_per_s": statistics.median(e["samples_per_s"] for e in epochs),
        "step_ms": statistics.median(e["step_ms"] for e in epochs),
        "comm_wait_ms": statistics.median(e["comm_wait_ms"] for e in epochs),
        "wall_s": wall,
    }


def table(results: dict[str, list[dict[str, float]]]) -> str:
    first = next(iter(results))
    base = statistics.median(r["samples_per_s"] for r in results[first])
    rows = [
        f"| variant | loss @ epoch {EARLY_EPOCH} | val accuracy @ epoch {EARLY_EPOCH} | final val accuracy (min-max) | "
        f"final loss | samples/s | vs {first} | step ms | step() waiting for comm, ms | launch.py wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        accs = [r["accuracy"] for r in runs]
        rows.append(
            f"| {name} | {med['early_loss']:.4f} | {med['early_accuracy']:.4f} | "
            f"{med['accuracy']:.4f} ({min(accs):.4f}-{max(accs):.4f}) | {med['loss']:.4f} | "
            f"{med['samples_per_s']:,.0f} | {med['samples_per_s'] / base:.2f}x | {med['step_ms']:.2f} | "
            f"{med['comm_wait_ms']:.2f} | {med['wall_s']:.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted([*SUITES, "backends", "scaling"]))
    parser.add_argument("--max-ranks", type=int, default=os.cpu_count() or 1, help="scaling: the largest rank count")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    if args.suite == "backends":
        variants = {"1 rank, no communication": [*WIDE, "resources.tasks_per_node=1"], **{f"2 ranks, comm={b}": [*WIDE, f"comm={b}"] for b in backend_names()}}
    elif args.suite == "scaling":
        variants = scaling_suite(args.max_ranks)
    else:
        variants = SUITES[args.suite]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name, overrides in variants.items():
                results[name].append(run_once(overrides, Path(tmp)))
    text = table(results)
    if args.suite == "scaling":
        text += "\n\n" + efficiency_table(results)
    print(text)
    if args.write:
        header = (
            f"\n### Training suite `{args.suite}` ({date.today().isoformat()}, {platform.node()}, {os.cpu_count()} cores)\n\n"
            f"`python benchmarks/training.py {args.suite} --repeats {args.repeats}"
            f"{f' --max-ranks {args.max_ranks}' if args.suite == 'scaling' else ''}` ({args.repeats} runs per variant, "
            "interleaved; medians of per-epoch figures after epoch 1)\n\n"
        )
        with args.write.open("a") as f:
            f.write(header + text + "\n")


if __name__ == "__main__":
    main()
