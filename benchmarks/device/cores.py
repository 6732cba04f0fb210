"""The device checks on CPU ranks (the GPU machine's 16 cores): the allreduce engine against
MPI_Allreduce and Gloo, the plain loop's scaling 1 -> 16 ranks against its no-communication
bound, and the loader's images/s per worker against the GPU step's consumption. Each part is
recorded as it finishes, so a check cut off by its budget keeps what it measured."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.device.report import ROOT, Report

ALLREDUCE_RANKS = {"gpu": (16, 8, 4), "cpu": (2,)}  # most valuable first
ALGOS = ("auto", "mpi", "gloo")  # ours against the MPI library's and torch's (ring, rhd: python -m collectives.bench)


def allreduce(mode: str, scratch: Path, report: Report) -> None:
    """collectives.bench (nccl-tests semantics, one launch per implementation) at each rank count."""
    sizes, iterations = (("1M", "64M", "8"), ("3", "10")) if mode == "gpu" else (("64K", "1M", "16"), ("1", "3"))
    algos = ALGOS
    warm, timed = iterations
    options = f"-b {sizes[0]} -e {sizes[1]} -f {sizes[2]} -w {warm} -n {timed} --rounds 1 --algos {','.join(algos)}"
    report.figure("set-up", f"python -m collectives.bench --np N {options}")
    for ranks in ALLREDUCE_RANKS[mode]:
        out = scratch / f"np{ranks}"
        command = [sys.executable, "-m", "collectives.bench", "--np", str(ranks), "-b", sizes[0], "-e", sizes[1], "-f", sizes[2]]
        command += ["-w", iterations[0], "-n", iterations[1], "--rounds", "1", "--algos", ",".join(algos), "--out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode or not (out / "bench.json").exists():
            raise RuntimeError(f"collectives.bench --np {ranks} failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
        rows = json.loads((out / "bench.json").read_text())["summary"]["rows"]
        busbw = {(r["impl"], r["bytes"]): r["busbw_gbs"] for r in rows}
        sizes_seen = sorted({b for _, b in busbw})
        lines = [
            f"{ranks} ranks, busbw GB/s (one round):",
            "",
            "| bytes | " + " | ".join(algos) + " | auto / mpi | auto / gloo |",
            "|" + " --- |" * (len(algos) + 3),
        ]
        for size in sizes_seen:
            cells = [f"{busbw.get((a, size), float('nan')):.2f}" for a in algos]
            ratios = [busbw[("auto", size)] / busbw[(other, size)] for other in ("mpi", "gloo")]
            lines.append(f"| {size:,} | " + " | ".join(cells) + " | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
        report.table("\n".join(lines))


SCALING_RANKS = {"gpu": (16, 8, 4), "cpu": (2,)}


def scaling(mode: str, scratch: Path, report: Report) -> None:
    """benchmarks/plain_loop.py's launches: 1 rank, then N ranks with no communication (the
    bound), with our optimizer and with DDP over Gloo; efficiency = samples/s / (N x 1 rank)."""
    from benchmarks import plain_loop

    scratch.mkdir(parents=True, exist_ok=True)
    steps = 20 if mode == "gpu" else 3
    report.figure("set-up", f"benchmarks/plain_loop.py launches: MLP of 3.2M parameters, batch 64 per rank, {steps} timed steps, one round")

    def run(name: str, ranks: int) -> float:
        args = argparse.Namespace(ranks=ranks, steps=steps, hidden=1024, batch=64)
        return float(plain_loop.launch(name, args, scratch, 0)["samples_s"])

    single = run("single", 2)
    report.figure("1 rank, samples/s", single)
    lines = ["| ranks | no communication (bound) | ours | DDP (Gloo) | ours / DDP | ours / bound |", "| --- | --- | --- | --- | --- | --- |"]
    for ranks in SCALING_RANKS[mode]:
        rate = {name: run(name, ranks) for name in ("nocomm", "ours", "ddp")}
        eff = {name: value / (ranks * single) for name, value in rate.items()}
        lines.append(
            f"| {ranks} | {rate['nocomm']:,.0f} ({eff['nocomm']:.2f}) | {rate['ours']:,.0f} ({eff['ours']:.2f}) | {rate['ddp']:,.0f} ({eff['ddp']:.2f}) "
            f"| {rate['ours'] / rate['ddp']:.2f}x | {rate['ours'] / rate['nocomm']:.2f} |"
        )
        report.data["tables"] = ["samples/s (efficiency against N x 1 rank):\n\n" + "\n".join(lines)]
        report.save()


LOADER_WORKERS = {"gpu": (1, 4, 8, 14), "cpu": (1, 2)}


def loader(mode: str, scratch: Path, report: Report) -> None:
    """The loader alone on uint8 3 x 224 x 224 shards in the page cache (benchmarks/loader.py's
    `ours`): images/s in total and per worker, against the GPU step's consumption (the resnet50
    check's raw loop, when it ran)."""
    import h5py
    import torch

    from benchmarks import loader as bench
    from trainers.data import reading as data_module
    from trainers.data.sampler import ShardSampler

    data_module.IN_MEMORY_LIMIT_BYTES = 0  # as benchmarks/loader.py: read from the files, as for a real data set
    torch.set_num_threads(1)
    images, batch, batches = (6000, 256, 20) if mode == "gpu" else (300, 16, 5)
    files = bench.make_shards(scratch, images)
    for path in files:  # into the page cache
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    total = sum(h5py.File(f, "r")["train/y"].shape[0] for f in files)
    consumption = gpu_consumption(scratch)
    report.figure("set-up", f"{total} images 3 x 224 x 224 uint8 in {len(files)} shards, page cache, batch {batch}, {batches} batches per run")
    lines = ["| workers | images/s | per worker | per CPU second | of the GPU step's rate |", "| --- | --- | --- | --- | --- |"]
    for workers in LOADER_WORKERS[mode]:
        chosen = list(ShardSampler(total, batch, 0, 1, seed=workers).batches(0))[: batches + 1]
        rate, per_cpu = bench.run_loader("ours", files, chosen, workers, batch, 2)
        share = f"{rate / consumption:.2f}x" if consumption else "n/a"
        lines.append(f"| {workers} | {rate:,.0f} | {rate / workers:,.0f} | {per_cpu:,.0f} | {share} |")
        report.data["tables"] = ["\n".join(lines)]
        report.save()
    if consumption:
        report.figure("GPU step's consumption (resnet50 raw loop), img/s", consumption)


def gpu_consumption(scratch: Path) -> float | None:
    """The resnet50 check's raw-loop images/s (the median over its rounds) from its result file beside this check's."""
    result = scratch.parent / "resnet50.json"
    try:
        return float(json.loads(result.read_text())["pairs"]["resnet50"]["reference_median"])
    except (OSError, KeyError, ValueError):
        return None
