"""The nanoGPT fragment of docs/your-code.md, run as written inside a tiny nanoGPT setup (its
globals: model, optimizer, get_lr, ctx, scaler, a train.bin): stopped by a real SIGUSR1 and
resumed, it logs every step's loss as nanoGPT's own `lossf` (the last micro-step's, undivided)
and ends with an uninterrupted run's losses and weights, bit for bit."""

from __future__ import annotations

import json
import math
import os
import signal
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hpc.rank.lifecycle import EXIT_RESUMABLE
from tests.support.docs import marked_blocks

(FRAGMENT,) = marked_blocks("docs/your-code.md", __file__)
VOCAB, ACCUMULATE, MAX_ITERS = 32, 2, 6


class TinyGPT(nn.Module):
    """nanoGPT's interface: model(X, Y) -> (logits, loss); dropout draws from torch's global generator."""

    def __init__(self, raw_losses: list[float], signal_at_call: int | None) -> None:
        super().__init__()
        self.embed, self.drop, self.head = nn.Embedding(VOCAB, 16), nn.Dropout(0.1), nn.Linear(16, VOCAB)
        self.raw_losses, self.signal_at_call = raw_losses, signal_at_call

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.drop(self.embed(x)))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.raw_losses.append(loss.item())
        if len(self.raw_losses) == self.signal_at_call:
            os.kill(os.getpid(), signal.SIGUSR1)
        return logits, loss


def nanogpt_globals(data_dir: Path, raw_losses: list[float], signal_at_call: int | None = None) -> dict:
    torch.manual_seed(1337)
    model = TinyGPT(raw_losses, signal_at_call)
    learning_rate = 1e-2

    def get_lr(it: int) -> float:  # nanoGPT's warm-up then cosine decay, a function of iter_num alone
        warmup, decay = 2, MAX_ITERS
        if it < warmup:
            return learning_rate * (it + 1) / (warmup + 1)
        return 1e-3 + 0.5 * (1 + math.cos(math.pi * (it - warmup) / (decay - warmup))) * (learning_rate - 1e-3)

    return {
        **{"np": np, "os": os, "torch": torch, "model": model, "get_lr": get_lr, "learning_rate": learning_rate},
        **{"optimizer": torch.optim.AdamW(model.parameters(), lr=learning_rate), "data_dir": str(data_dir), "ddp": False, "ddp_rank": 0},
        **{"device": "cpu", "block_size": 8, "batch_size": 4, "gradient_accumulation_steps": ACCUMULATE, "max_iters": MAX_ITERS},
        **{"decay_lr": True, "grad_clip": 1.0, "ctx": nullcontext(), "scaler": torch.amp.GradScaler("cpu", enabled=False)},
    }


def start(run_dir: Path, data_dir: Path, raw_losses: list[float], monkeypatch, signal_at_call: int | None = None) -> dict:
    monkeypatch.setenv("HPCTK_RUN_DIR", str(run_dir))  # what the docs lead with for ranks started by hand
    scope = nanogpt_globals(data_dir, raw_losses, signal_at_call)
    exec(compile(FRAGMENT.body, FRAGMENT.where, "exec"), scope)  # noqa: S102 - the docs' own block
    return scope


def logged(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def test_the_docs_nanogpt_loop_logs_nanogpts_loss_and_resumes_bit_exactly(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    np.random.default_rng(0).integers(0, VOCAB, size=4096).astype(np.uint16).tofile(data_dir / "train.bin")

    raw: list[float] = []
    whole = start(tmp_path / "whole", data_dir, raw, monkeypatch)
    reference = logged(tmp_path / "whole")
    assert len(reference) == MAX_ITERS and whole["iter_num"] == MAX_ITERS
    # nanoGPT's own figure: the last micro-step's loss, not divided by the accumulation steps
    assert reference == pytest.approx(raw[ACCUMULATE - 1 :: ACCUMULATE], rel=1e-6)

    with pytest.raises(SystemExit) as stopped:  # SIGUSR1 during step 3's forward: the ranks stop at an agreed step
        start(tmp_path / "run", data_dir, [], monkeypatch, signal_at_call=5)
    assert stopped.value.code == EXIT_RESUMABLE
    resumed = start(tmp_path / "run", data_dir, [], monkeypatch)
    assert resumed["run"].resumed_from is not None and 0 < resumed["run"].resumed_from < MAX_ITERS
    assert logged(tmp_path / "run") == reference
    assert all(torch.equal(a, b) for a, b in zip(resumed["model"].parameters(), whole["model"].parameters(), strict=True))
