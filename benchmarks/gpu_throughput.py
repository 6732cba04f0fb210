"""The trainer's images/s against a raw PyTorch loop, same machine, same run (issue 6).

    python benchmarks/gpu_throughput.py [--n 5120] [--batch 256] [--model resnet50] [--steps 20]
    python benchmarks/gpu_throughput.py --workers 4 --augment   # loader processes, crop + flip on the GPU
    python benchmarks/gpu_throughput.py --device cpu --model cnn --shape 3,32,32 --batch 32 --n 512   # plumbing check

1. Writes synthetic images as uint8 to an HDF5 file (N x C x H x W, random labels).
2. Raw loop: the model (channels_last, bf16 autocast, SGD) on a batch already on the device,
   `--steps` timed steps after 5 warm-up steps: the bar.
3. The trainer: `python launch.py comm=nccl` (gloo with --device cpu) on 1 rank reading that HDF5
   file through its prefetching loader, same model, batch, precision and memory format; the
   images/s of its second epoch and the share of step time it waited for data.
Prints both and their ratio (target >= 0.97x, data wait < 3%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


def write_images(path: Path, n: int, shape: tuple[int, ...], classes: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f.attrs["num_classes"] = classes
        for split, count in (("train", n), ("val", max(n // 10, 1))):
            x = f.create_dataset(f"{split}/x", shape=(count, *shape), dtype=np.uint8)
            for lo in range(0, count, 256):  # in slices: N x 3 x 224 x 224 does not fit one array
                x[lo : lo + 256] = rng.integers(0, 256, size=(min(256, count - lo), *shape), dtype=np.uint8)
            f.create_dataset(f"{split}/y", data=rng.integers(0, classes, size=count))


def raw_loop(model_name: str, shape: tuple[int, ...], classes: int, batch: int, steps: int, device: torch.device, host_syncs: bool = False) -> float:
    """Images/s of the bare loop; `host_syncs`: with the three waits for the device per step the
    trainer made before issue 43 (the loss read after backward, the finite-gradients check, the
    step's figures read back at once after their allreduce; it now reads one, a step late), to
    tell what such waits cost."""
    from trainers.config import ModelConfig
    from trainers.models import build_model

    model = build_model(ModelConfig(name=model_name, hidden_sizes=[] if model_name == "resnet50" else [128]), shape, classes)
    model = model.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randint(0, 256, (batch, *shape), dtype=torch.uint8, device=device).float().div_(255).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        if host_syncs:
            wait_as_the_trainer_does(model, loss)
        optimizer.step()
        optimizer.zero_grad()
        if host_syncs:
            torch.zeros(16, dtype=torch.float64).to(device).tolist()

    for _ in range(5):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - started)


def wait_as_the_trainer_does(model: torch.nn.Module, loss: torch.Tensor) -> None:
    """The two waits for the device the trainer made between backward and the optimizer step
    before issue 43 (it now skips a non-finite step on the device, reading nothing)."""
    from collectives.replicated import grads_finite

    loss.item()
    grads_finite(model)


def trainer(data: Path, model_name: str, batch: int, device: torch.device, workdir: Path, loading: list[str]) -> dict[str, float]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    overrides = [
        f"comm={backend}",
        f"model={model_name}",
        f"data.path={data}",
        f"data.batch_size={batch}",
        "data.eval_batch_size=256",
        "trainer.precision=bf16",
        "trainer.channels_last=true",
        "trainer.epochs=2",
        "checkpoint.enabled=false",
        "resources.tasks_per_node=1",
        "optim.schedule=constant",
        f"run_root={workdir / 'runs'}",
        f"trainer.threads_per_rank={torch.get_num_threads()}",  # as many threads as the raw loop
        *loading,
    ]
    if device.type == "cuda":
        overrides += ["resources.gpus_per_task=1", "cluster.gpus_per_node=1"]
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), *overrides], capture_output=True, text=True, cwd=workdir)
    if done.returncode:
        raise SystemExit(f"the trainer failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (metrics,) = (workdir / "runs").glob("*/*/metrics.jsonl")
    last = json.loads(metrics.read_text().splitlines()[-1])
    steps = [json.loads(line) for line in (metrics.parent / "steps.jsonl").read_text().splitlines()]
    phases = {key: statistics.median(s[key] for s in steps if s["epoch"] == last["epoch"]) for key in PHASE_KEYS}
    return {"images_per_s": last["samples_per_s"], "data_wait_share": last["data_wait_ms"] / last["step_ms"], **phases}


PHASE_KEYS = ("step_ms", "data_ms", "compute_ms", "comm_ms", "optimizer_ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=5120, help="training images")
    parser.add_argument("--shape", default="3,224,224")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=0, help="the trainer's data.workers (loader processes)")
    parser.add_argument("--augment", action="store_true", help="the trainer crops (data.crop = the image size) and flips on the device")
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        workdir = Path(tmp)
        data = workdir / "images.h5"
        write_images(data, args.n, shape, args.classes)
        raw = raw_loop(args.model, shape, args.classes, args.batch, args.steps, device)
        loading = [f"data.workers={args.workers}", *([f"data.crop={shape[-1]}", "data.flip=true"] if args.augment else [])]
        ours = trainer(data, args.model, args.batch, device, workdir, loading)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{args.model}, batch {args.batch}, bf16, channels_last, {shape} uint8 HDF5, {name}")
    print("| figure | value |")
    print("| --- | --- |")
    print(f"| raw PyTorch loop (batch on the device) | {raw:,.0f} img/s |")
    loader = f"data.workers={args.workers}" + (", crop + flip" if args.augment else "")
    print(f"| trainer, comm={'nccl' if device.type == 'cuda' else 'gloo'}, 1 rank, HDF5 loader ({loader}) | {ours['images_per_s']:,.0f} img/s |")
    print(f"| trainer / raw | {ours['images_per_s'] / raw:.2f}x |")
    print(f"| trainer's step time waiting for data | {ours['data_wait_share']:.1%} |")


if __name__ == "__main__":
    main()
