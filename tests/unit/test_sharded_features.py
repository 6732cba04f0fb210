"""The trainer's features under comm.sharding, through fit() on a user-style task (the built-in
language model: parameter groups, blocks to recompute): ZeRO-1/2 on thread ranks and FSDP2 on a
gloo group of one rank, each with activation checkpointing, accumulation and clipping by global
norm, against replicated training with the same features; ZeRO-1 under fp16's grad scaler; and
FSDP2 stopped and resumed bit for bit with all of them on."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from collectives.config import CommConfig
from collectives.testing import ThreadWorld
from collectives.torchdist import TorchDistCollectives
from tests.support.fit_in_process import builtin_task, config, counting_blocks, steps_of, train
from tests.support.ranks import gloo_world_of_one
from trainers.config import ModelConfig, OptimConfig
from trainers.context import FitConfig

STEPS = 8


def small_lm(tokens: Path) -> Any:
    from trainers.data.tokens import embedded_corpus, write_token_file
    from trainers.tasks.lm import LanguageModelTask

    if not tokens.exists():
        write_token_file(embedded_corpus()[:30000], tokens)
    # No dropout: thread ranks share torch's global random numbers
    return LanguageModelTask(tokens=str(tokens), context=16, layers=2, heads=2, width=32, dropout=0.0)


def lm_config(sharding: str, backend: str = "mpi", recompute: bool = True, **trainer: object) -> FitConfig:
    cfg = config(max_steps=STEPS, batch_size=8, every_steps=4)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_batch_size=64))  # few evaluation forwards
    features = {"activation_checkpointing": recompute, "accumulation_steps": 2, "clip_grad_norm": 0.05, **trainer}
    return dataclasses.replace(
        cfg,
        optim=dataclasses.replace(cfg.optim, name="adamw", lr=3e-3, weight_decay=0.1),  # the task's groups: matrices decay, the rest not
        trainer=dataclasses.replace(cfg.trainer, **features),
        comm=CommConfig(backend=backend, bucket_mb=0.005, sharding=sharding),  # small buckets: parameters split between ranks
    )


def losses(run_dir: Path) -> list[float]:
    return [s["loss"] for s in steps_of(run_dir)]


def fit_threads(run_dir: Path, tokens: Path, cfg: FitConfig, ranks: int = 2) -> list[int]:
    """fit() of the small language model on thread ranks; each rank's recomputation count."""
    counts: list[int] = [0] * ranks

    def rank(comm: Any) -> None:
        task, calls = counting_blocks(small_lm(tokens))
        train(run_dir, task, cfg, comm)
        counts[comm.rank] = calls[0]

    ThreadWorld(ranks).run(rank)
    return counts


@pytest.mark.parametrize("sharding", ["optimizer", "gradients"])
def test_zero_with_recomputation_accumulation_and_clipping_trains_as_replicated(tmp_path: Path, sharding: str) -> None:
    tokens = tmp_path / "tokens.h5"
    small_lm(tokens)  # written once, before the rank threads read it
    sharded = fit_threads(tmp_path / "sharded", tokens, lm_config(sharding))
    fit_threads(tmp_path / "replicated", tokens, lm_config("none"))
    kept = fit_threads(tmp_path / "kept", tokens, lm_config(sharding, recompute=False))
    assert len(losses(tmp_path / "sharded")) == STEPS
    assert losses(tmp_path / "sharded") == pytest.approx(losses(tmp_path / "replicated"), rel=1e-5)
    assert losses(tmp_path / "kept") == pytest.approx(losses(tmp_path / "sharded"), rel=1e-5)
    blocks, micro_steps = 2, 2 * STEPS
    assert [s - k for s, k in zip(sharded, kept, strict=True)] == [blocks * micro_steps] * 2  # every block recomputed in every backward
    fit_threads(tmp_path / "unclipped", tokens, lm_config(sharding, clip_grad_norm=None))
    assert losses(tmp_path / "unclipped") != pytest.approx(losses(tmp_path / "sharded"), rel=1e-5)  # the clip did bite


def fit_config_fp16(sharding: str) -> FitConfig:
    cfg = config(max_steps=6, batch_size=32, every_steps=3)
    return dataclasses.replace(
        cfg,
        model=ModelConfig(hidden_sizes=[32, 16]),
        optim=OptimConfig(name="adamw", lr=0.01),
        trainer=dataclasses.replace(cfg.trainer, precision="fp16", clip_grad_norm=0.5, epochs=1),
        comm=CommConfig(bucket_mb=0.002, sharding=sharding),
    )


def test_zero1_under_fp16s_grad_scaler_trains_as_replicated_and_keeps_the_scale(tmp_path: Path) -> None:
    """The scaler unscales the whole averaged gradients ZeRO-1 keeps (the same on every rank, so
    every rank skips the same steps) before the sharded step."""
    from benchmarks.rundirs import newest_shared_state

    for run, sharding in (("sharded", "optimizer"), ("replicated", "none")):
        cfg = fit_config_fp16(sharding)
        ThreadWorld(2).run(lambda comm, cfg=cfg, run=run: train(tmp_path / run, builtin_task(cfg), cfg, comm))
    assert len(losses(tmp_path / "sharded")) == 6
    assert losses(tmp_path / "sharded") == pytest.approx(losses(tmp_path / "replicated"), rel=1e-3)
    scaler = newest_shared_state(tmp_path / "sharded")["scaler"]
    assert scaler["scale"] == newest_shared_state(tmp_path / "replicated")["scaler"]["scale"] > 0


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[TorchDistCollectives]:
    with gloo_world_of_one(tmp_path / "store"):
        yield TorchDistCollectives("gloo", torch.device("cpu"))


def test_fsdp2_with_recomputation_accumulation_and_clipping_trains_as_ddp_and_resumes_bit_for_bit(tmp_path: Path, one_rank: TorchDistCollectives) -> None:
    tokens = tmp_path / "tokens.h5"
    full = lm_config("full", backend="gloo")
    task, calls = counting_blocks(small_lm(tokens))
    train(tmp_path / "full", task, full, one_rank)
    kept_task, kept_calls = counting_blocks(small_lm(tokens))  # DDP keeping the activations
    train(tmp_path / "ddp", kept_task, lm_config("none", backend="gloo", recompute=False), one_rank)
    assert len(losses(tmp_path / "full")) == STEPS
    assert losses(tmp_path / "full") == pytest.approx(losses(tmp_path / "ddp"), rel=1e-5)
    assert calls[0] - kept_calls[0] == 2 * 2 * STEPS  # 2 blocks recomputed in each of 2 backward passes per step
    # Stopped after step 5 (between the saves at 4 and 8: the stop's own save) and resumed: the
    # same losses, bit for bit.
    train(tmp_path / "cut", small_lm(tokens), full, one_rank, stop_at=5)
    train(tmp_path / "cut", small_lm(tokens), full, one_rank)
    resumed = {s["step"]: s["loss"] for s in steps_of(tmp_path / "cut")}
    assert [resumed[step] for step in sorted(resumed)] == losses(tmp_path / "full")
