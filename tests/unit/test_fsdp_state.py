"""FSDP2's state as the checkpoints keep it (collectives/fsdp.py, trainers/checkpoint/registry.py), in-process
on a gloo group of one rank: the rows saved as pieces load back bit for bit, into an FSDP model or
assembled into a plain one, whole tensors into an FSDP model, and the registry refuses DTensors it
cannot save yet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from collectives import fsdp
from tests.support.ranks import gloo_world_of_one
from trainers.checkpoint.checkpointer import CheckpointError
from trainers.checkpoint.registry import Registry, per_rank
from trainers.gpt import GPT, GPTShape, next_token_loss
from trainers.task import TaskError

SHAPE = GPTShape(vocab_size=32, context=8, layers=2, heads=2, width=16)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    with gloo_world_of_one(tmp_path / "store"):
        yield


def build(sharded: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(SHAPE)
    if sharded:
        fsdp.shard_model(model, model.blocks)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        tokens = torch.randint(0, SHAPE.vocab_size, (4, SHAPE.context + 1), generator=torch.Generator().manual_seed(step))
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def copied(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: copied(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copied(v) for v in obj]
    return obj


def saved_registry(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """A registry's shared state and this rank's own file, copied as a checkpoint's files are (the
    pieces are views of the live rows)."""
    registry = Registry({"model": model, "optimizer": optimizer})
    return copied(registry.shared_state()), {"dtensor_pieces": copied(registry.dtensor_pieces())}


def switched(saved_sharded: bool, own_file: bool) -> tuple[list[float], list[float], nn.Module, torch.optim.Optimizer]:
    """Three steps trained sharded or not, saved, and two more; a fresh model of the other kind
    resumed from the save (with this rank's own file, or from every rank's) and stepped twice:
    both continuations' losses, and the resumed model and optimizer."""
    model, optimizer = build(sharded=saved_sharded)
    train(model, optimizer, 3)
    shared, own = saved_registry(model, optimizer)
    straight = train(model, optimizer, 2, first=3)
    other, other_optimizer = build(sharded=not saved_sharded)
    Registry({"model": other, "optimizer": other_optimizer}).load(3, copied(shared), own if own_file else None, lambda: [own])
    return straight, train(other, other_optimizer, 2, first=3), other, other_optimizer


def test_a_run_changes_between_fsdp2_rows_and_whole_tensors_and_continues_bit_for_bit(one_rank: None) -> None:
    """comm.sharding=full saved, resumed without sharding (rows assembled whole), and the other
    way (whole tensors cut to this rank's rows, the optimizer's state not created yet): on one
    rank the continuation is the sharded run's own."""
    straight, resumed, plain, plain_optimizer = switched(saved_sharded=True, own_file=False)
    assert not any(fsdp.is_distributed_tensor(v) for v in [*plain.state_dict().values(), *plain_optimizer.state_dict()["state"][0].values()])
    assert resumed == pytest.approx(straight, rel=1e-6)

    straight, resumed, _, sharded_optimizer = switched(saved_sharded=False, own_file=True)
    assert all(fsdp.is_distributed_tensor(v) for v in sharded_optimizer.state_dict()["state"][0].values() if v.dim())
    assert resumed == pytest.approx(straight, rel=1e-6)


def test_a_truncated_shard_is_named(one_rank: None) -> None:
    model, optimizer = build(sharded=True)
    train(model, optimizer, 1)
    shared, own = saved_registry(model, optimizer)
    first = own["dtensor_pieces"]["pieces"][0]
    first["stop"] -= 1
    first["ranged"]["value"] = first["ranged"]["value"][:-1]
    fresh, fresh_optimizer = build(sharded=True)
    with pytest.raises(CheckpointError, match=r"checkpoint step 1 does not fit run state 'model': .*cover"):
        Registry({"model": fresh, "optimizer": fresh_optimizer}).load(1, shared, own, lambda: [own])


def test_the_run_handle_saves_a_scripts_fsdp2_model_and_optimizer_and_resumes_bit_for_bit(one_rank: None) -> None:
    """A script's own fully_shard model and optimizer registered with the run handle: the shared
    state keeps markers, each rank's file its rows, and a fresh registry continues exactly."""
    model, optimizer = build(sharded=True)
    train(model, optimizer, 3)
    shared, own = saved_registry(model, optimizer)
    assert "DTensor" not in repr(shared) and own["dtensor_pieces"]["pieces"]
    straight = train(model, optimizer, 2, first=3)

    resumed, resumed_optimizer = build(sharded=True)
    Registry({"model": resumed, "optimizer": resumed_optimizer}).load(3, copied(shared), own, lambda: [own])  # a fresh read each time:
    # the optimizer keeps the loaded step-count tensors themselves and counts on in them
    assert train(resumed, resumed_optimizer, 2, first=3) == straight
    # Without its own file (another world size): from every rank's, the same rows.
    again, again_optimizer = build(sharded=True)
    Registry({"model": again, "optimizer": again_optimizer}).load(3, copied(shared), None, lambda: [own])
    assert train(again, again_optimizer, 2, first=3) == straight


def test_the_run_handle_refuses_dtensors_kept_per_rank(one_rank: None) -> None:
    model, _ = build(sharded=True)
    with pytest.raises(TaskError, match="is a DTensor .FSDP2's sharded tensor.: register it as shared run state"):
        Registry({"model": per_rank(model)}).own_state()
