"""A nanoGPT-like training script for the device suite's `nanogpt` check (issue 43): karpathy/nanoGPT's
train.py and model.py in outline, self-contained (the GPU machine has no network to clone it).
The same file runs two ways:

    torchrun --standalone --nproc-per-node 1 nanogpt_like.py --out A.json [shape...]
    python launch.py script=nanogpt_like.py resources.tasks_per_node=1 ... -- --handle --out B.json [shape...]

nanoGPT's parts kept: its GPT (pre-LayerNorm blocks without biases, fused causal attention, GELU
MLP, tied embedding and head, its initialisation), AdamW with decayed and undecayed groups (fused
on CUDA), its learning-rate schedule set by hand each iteration, bf16 autocast, random-offset
batches read from a uint16 memmap each iteration, pinned and copied non_blocking, the next batch
fetched while the GPU works, gradient clipping, DDP whenever RANK is set (both ways here), and
`loss.item()` every --log-interval iterations. Left out: evaluation and nanoGPT's own ckpt.pt.

`--handle` adds the run handle's four lines, as benchmarks/nanogpt_handle.py adds them to
nanoGPT's own train.py: `start_run(model=..., optimizer=...)` after the optimizer is made (its
step is the iteration to start from), `run.end_step(loss=...)` after each iteration (stop when it
says so), `run.finish()` after the loop. Both ways time the iterations after --warmup by the wall
clock, the device synchronised at both ends, and rank 0 writes one JSON object to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width, bias=False)
        self.c_proj = nn.Linear(width, width, bias=False)
        self.resid_dropout = nn.Dropout(dropout)
        self.heads, self.dropout = heads, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (part.view(b, t, self.heads, c // self.heads).transpose(1, 2) for part in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width, bias=False), nn.LayerNorm(width, bias=False)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(), nn.Linear(4 * width, width, bias=False), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, heads: int, width: int, dropout: float) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, bias=False)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("c_proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def token_file(folder: Path) -> tuple[Path, int]:
    """train.bin (uint16 character ids, nanoGPT's layout) from CPython's own documentation."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    path = folder / "train.bin"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        stoi = {c: i for i, c in enumerate(chars)}
        partial = folder / f".train.{os.getpid()}"
        np.array([stoi[c] for c in text], dtype=np.uint16).tofile(partial)
        partial.replace(path)
    return path, len(chars)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--handle", action="store_true", help="with the run handle (under launch.py)")
    p.add_argument("--data", type=Path, default=Path.home() / ".cache" / "nanogpt_like")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=50, help="iterations left out of the timing")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    ddp = int(os.environ.get("RANK", -1)) != -1  # as nanoGPT: a torchrun-style launch
    if ddp:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    else:
        rank = local_rank = 0
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    path, vocab = token_file(args.data)
    torch.manual_seed(1337 + rank)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(path, dtype=np.uint16, mode="r")  # nanoGPT maps it anew each batch (a leak otherwise)
        ix = torch.randint(len(data) - args.block, (args.batch,))
        x = torch.stack([torch.from_numpy(data[i : i + args.block].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + args.block].astype(np.int64)) for i in ix.tolist()])
        if cuda:
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    model = GPT(vocab, args.block, args.layers, args.heads, args.width, args.dropout).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99), fused=cuda)
    iter_num, run = 0, None
    if args.handle:
        from hpc.run import start_run

        run = start_run(model=model, optimizer=optimizer)
        iter_num = run.step
    trained = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None) if ddp else model

    def lr_at(it: int) -> float:  # nanoGPT's get_lr: linear warm-up, cosine decay to a tenth
        warm, decay_iters = 10, args.iters
        if it < warm:
            return args.lr * (it + 1) / (warm + 1)
        ratio = min(1.0, (it - warm) / max(1, decay_iters - warm))
        return args.lr / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.lr / 10)

    x, y = get_batch()
    began, timed_from, lossf = 0.0, iter_num + args.warmup, float("nan")
    while iter_num < args.iters:
        if iter_num == timed_from:
            torch.cuda.synchronize() if cuda else None
            began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(iter_num)
        with autocast:
            loss = trained(x, y)
        x, y = get_batch()  # the next batch while the GPU works on this one
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if iter_num % args.log_interval == 0 and rank == 0:
            lossf = loss.item()
            print(f"iter {iter_num}: loss {lossf:.4f}", flush=True)
        iter_num += 1
        if run is not None and run.end_step(loss=loss.detach()):
            break
    torch.cuda.synchronize() if cuda else None
    seconds = time.perf_counter() - began
    timed = iter_num - timed_from
    if run is not None:
        run.finish()
    if rank == 0:
        tokens = args.batch * args.block * (dist.get_world_size() if ddp else 1)
        figures = {"tokens_per_s": tokens * timed / seconds, "iter_ms": 1000 * seconds / timed, "iters_timed": timed, "loss": lossf, "handle": args.handle}
        args.out.write_text(json.dumps(figures))
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
