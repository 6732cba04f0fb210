"""A character-level GPT written the way nanoGPT's train.py is: random-offset batches from a
memory-mapped token file, evaluation every --eval-every iterations, AdamW with decayed and
undecayed parameter groups, linear warm-up then cosine decay, gradient accumulation and clipping,
and text sampled at the end. The run handle (hpc.run) adds what such a script lacks: an agreed
stop on preemption with a committed checkpoint, and an exact resume (batches and dropout too)."""

import argparse
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from hpc.run import RandomWindows, start_run


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, width: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.tokens, self.places = nn.Embedding(vocab, width), nn.Embedding(block_size, width)
        self.blocks = nn.Sequential(*[Block(width, heads, dropout) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.places(torch.arange(idx.size(1), device=idx.device))
        return self.head(self.ln(self.blocks(x)))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1]
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx


def token_files(folder: Path) -> dict[str, np.memmap]:
    """train.bin and val.bin (uint8 bytes of text), made once from CPython's own docs."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "val.bin").exists():
        from pydoc_data.topics import topics

        data = np.frombuffer("\n".join(topics[k] for k in sorted(topics)).encode(), dtype=np.uint8)
        for split, part in (("train", data[: len(data) * 9 // 10]), ("val", data[len(data) * 9 // 10 :])):
            partial = folder / f".{split}.{os.getpid()}"  # every rank may write: each its own, then a rename
            part.tofile(partial)
            partial.replace(folder / f"{split}.bin")
    return {split: np.memmap(folder / f"{split}.bin", dtype=np.uint8, mode="r") for split in ("train", "val")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--data", default="~/.cache/char_gpt")
    p.add_argument("--run-dir", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = token_files(Path(args.data).expanduser())

    torch.manual_seed(1337)
    model = GPT(256, args.block, args.width, args.layers, heads=4, dropout=0.1)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99))

    def lr_at(it: int) -> float:
        if it < args.warmup:
            return (it + 1) / args.warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (it - args.warmup) / max(1, args.iters - args.warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    train, val = (RandomWindows(data[s], args.block, args.batch, seed=1337, rank=rank) for s in ("train", "val"))
    torch.manual_seed(1337 + rank)
    # batches numbered by step (RandomWindows.batch): the same after a resume, nothing to register
    run = start_run(args.run_dir, model=model, optimizer=optimizer, scheduler=scheduler, best_val=float("inf"))
    ddp = DistributedDataParallel(model)

    @torch.no_grad()
    def estimate_val_loss() -> float:
        model.eval()
        batches = (val.batch(run.step * args.eval_iters + i) for i in range(args.eval_iters))
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches]
        model.train()
        return sum(losses) / len(losses)

    while run.step < args.iters:
        for micro in range(args.accumulate):
            x, y = train.batch(run.step * args.accumulate + micro)
            ddp.require_backward_grad_sync = micro == args.accumulate - 1  # gradients meet once per step
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()) / args.accumulate
            loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if run.end_step(loss=loss * args.accumulate, lr=scheduler.get_last_lr()[0]):
            break
        if run.step % args.eval_every == 0:
            val_loss = estimate_val_loss()
            run["best_val"] = min(run["best_val"], val_loss)
            run.log(val_loss=val_loss)  # metrics.jsonl; rank 0's figure
            if run.is_main:
                print(f"iter {run.step}: val loss {val_loss:.4f}")
    run.finish()
    if run.is_main:
        sample = model.eval().generate(torch.tensor([[ord("\n")]]), 200)[0].tolist()
        print(bytes(sample).decode("utf-8", errors="replace"))
        print(f"best val loss {run['best_val']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
