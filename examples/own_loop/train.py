"""A plain PyTorch DDP training script that keeps the toolkit's guarantees through its run handle:
preempted, it stops with every rank at the same step and a committed checkpoint, and resumes
exactly where it stopped. Runs under launch.py, torchrun (--run-dir) or mpirun alike."""

import argparse
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpc.run import start_run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--run-dir", default=None)  # started by hand (torchrun); launch.py gives its own
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    cosine = lambda step: 0.5 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(8192, 16, generator=data)
    y = (x[:, :8].sum(1, keepdim=True) / 3).sin()
    x, y = x.to(device), y.to(device)
    torch.manual_seed(1 + rank)  # dropout: each rank its own stream (a resume restores it)

    # The handle: the state to keep; it resumes from the newest checkpoint, or starts fresh.
    run = start_run(args.run_dir, model=model, optimizer=optimizer, scheduler=scheduler)
    ddp = DistributedDataParallel(model)
    while run.step < args.steps:
        # The data position is the step count: a resumed run reads the batches it would have.
        start = (run.step * world + rank) * args.batch % len(x)
        inputs, targets = x[start : start + args.batch], y[start : start + args.batch]
        loss = nn.functional.mse_loss(ddp(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if run.end_step(loss=loss, lr=scheduler.get_last_lr()[0]):  # every rank alike: True = stop now
            break
    run.finish()  # the final checkpoint; after a stop, the process ends here and the job resumes

    with torch.no_grad():
        val_loss = nn.functional.mse_loss(model.eval()(x[:1024]), y[:1024]).item()
    run.log(val_loss=val_loss)  # metrics.jsonl: hpc.status, hpc.report and sweep.objective read it
    if run.is_main:
        print(f"trained {run.step} steps, val_loss {val_loss:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
