"""Checkpoint figures, each side by side with its baseline in one run.

    python benchmarks/checkpoint.py [--mb 256] [--repeats 5] [--dir /path/on/the/target/disk]

1. Save bandwidth: a synchronous Checkpointer save (write, fsync, rename, checksums, marker) of
   an optimizer-sized state, against a raw sequential write + fsync of the same bytes.
2. Training stall: what an async save blocks the training thread for, against a synchronous
   save of the same state. Parameters and optimizer state are copied by the writer thread while
   the next step computes; the training thread waits only if that copy is not done when the
   optimizer step comes (the fence). Measured with the fence right after the save (no compute
   to hide the copy behind: the worst case) and after a step of --step-ms of compute. One
   Checkpointer per mode across repeats, as in training.
Medians over interleaved repeats.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.tensorfile import write_tensor_file


def make_state(megabytes: int) -> dict[str, torch.Tensor]:
    count = megabytes * (1 << 20) // 4 // 2
    return {"model.weight": torch.randn(count), "optimizer.momentum": torch.randn(count)}


def raw_write(path: Path, payload: bytes) -> float:
    started = time.perf_counter()
    with path.open("wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def compute_for(seconds: float) -> None:
    """The training thread's next forward and backward: matrix products for `seconds`."""
    a = torch.randn(256, 256)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


def checkpoint_save(ckpt: Checkpointer, step: int, state: dict[str, torch.Tensor], asynchronous: bool, step_s: float = 0.0) -> tuple[float, float]:
    """(seconds the training thread was blocked: in the save, and at the next optimizer step's
    fence after `step_s` of compute; seconds until committed)."""
    started = time.perf_counter()
    ckpt.begin_save(step, state, {"rng": torch.get_rng_state()}, asynchronous, later=lambda t: True)  # the state is all weights
    blocked = time.perf_counter() - started
    if asynchronous:
        compute_for(step_s)
        blocked += ckpt.fence()
    ckpt.wait_written()
    ckpt.commit()
    elapsed = time.perf_counter() - started
    ckpt.wait_pruned()  # old checkpoints are deleted in the background: not part of a save, but
    return blocked, elapsed  # the next measurement must not share the disk with it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="state size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--step-ms", type=float, default=50.0, help="compute between an async save and the next optimizer step")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-bench-"))
    try:
        state = make_state(args.mb)
        sample = base / "sample.ckpt"
        write_tensor_file(sample, state)
        payload = sample.read_bytes()
        nbytes = len(payload)
        raw, sync_total, async_blocked, async_total, worst_blocked = [], [], [], [], []
        sync_ckpt, async_ckpt = (Checkpointer(base / mode, rank=0, world_size=1, keep=2) for mode in ("sync", "async"))
        first_blocked = checkpoint_save(async_ckpt, 0, state, asynchronous=True)[0]  # allocates the host copies
        for i in range(args.repeats):
            raw.append(raw_write(base / f"raw-{i}.bin", payload))
            (base / f"raw-{i}.bin").unlink()
            sync_total.append(checkpoint_save(sync_ckpt, 2 * i + 1, state, asynchronous=False)[1])
            blocked, total = checkpoint_save(async_ckpt, 2 * i + 2, state, asynchronous=True, step_s=args.step_ms / 1e3)
            async_blocked.append(blocked)
            async_total.append(total)
            worst_blocked.append(checkpoint_save(async_ckpt, 2 * i + 2 + 10_000, state, asynchronous=True)[0])
        med = statistics.median

        def gbps(seconds: float) -> float:
            return nbytes / seconds / 1e9

        print(f"state {nbytes / 2**20:.0f} MiB, {args.repeats} repeats, dir {base}")
        print("| figure | value |")
        print("| --- | --- |")
        print(f"| raw sequential write + fsync | {gbps(med(raw)):.2f} GB/s ({med(raw) * 1e3:.0f} ms) |")
        print(f"| checkpoint save, synchronous (write, fsync, rename, sha256, marker) | {gbps(med(sync_total)):.2f} GB/s ({med(sync_total) * 1e3:.0f} ms) |")
        print(f"| save bandwidth vs raw write | {med(raw) / med(sync_total):.2f}x |")
        print(f"| async save, optimizer step {args.step_ms:.0f} ms later: training thread blocked | {med(async_blocked) * 1e3:.1f} ms |")
        print(f"| async stall vs synchronous save | {med(async_blocked) / med(sync_total):.1%} |")
        worst = med(worst_blocked)
        print(f"| async save, optimizer step at once (no compute to hide the copy): blocked | {worst * 1e3:.1f} ms ({worst / med(sync_total):.1%}) |")
        print(f"| first async save of a run: blocked (allocates the host copies) | {first_blocked * 1e3:.0f} ms |")
        print(f"| async save until committed | {med(async_total) * 1e3:.0f} ms |")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
