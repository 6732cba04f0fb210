"""FSDP2's state as the checkpoints keep it (collectives/fsdp.py, trainers/checkpoint/shards.py), in-process on
a gloo group of one rank: the rows saved as pieces load back bit for bit, into an FSDP model or
assembled into a plain one, and the run handle refuses DTensors it cannot save yet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from collectives import fsdp
from collectives.zero import full_state
from tests.support.ranks import gloo_world_of_one
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


def test_rows_saved_as_pieces_resume_bit_for_bit_sharded_or_whole(one_rank: None) -> None:
    model, optimizer = build(sharded=True)
    train(model, optimizer, 3)
    # Copies, as a checkpoint's files are: the pieces are views of the live rows.
    model_pieces, optimizer_pieces = copied(fsdp.model_shard_state(model)), copied(fsdp.optimizer_shard_state(optimizer))
    whole = copied(fsdp.whole_model_state(model))
    groups = optimizer.state_dict()["param_groups"]
    straight = train(model, optimizer, 2, first=3)

    resumed, resumed_optimizer = build(sharded=True)
    fsdp.load_model_shards(resumed, whole, [model_pieces])
    resumed_optimizer.load_state_dict({"state": {}, "param_groups": groups})
    fsdp.load_optimizer_shards(resumed_optimizer, [optimizer_pieces])
    assert train(resumed, resumed_optimizer, 2, first=3) == straight

    # Assembled into a plain model and optimizer: the same continuation (one rank: the same sums).
    plain, plain_optimizer = build(sharded=False)
    shapes = {name: list(value.shape) for name, value in plain.state_dict().items()}
    plain.load_state_dict({**whole, **fsdp.full_model_state([model_pieces], shapes)})
    plain_optimizer.load_state_dict({"state": full_state(plain_optimizer, [optimizer_pieces]), "param_groups": groups})
    assert train(plain, plain_optimizer, 2, first=3) == pytest.approx(straight, rel=1e-6)


def test_a_truncated_shard_is_named(one_rank: None) -> None:
    model, optimizer = build(sharded=True)
    train(model, optimizer, 1)
    pieces = fsdp.model_shard_state(model)
    first = pieces["pieces"][0]
    first["stop"] -= 1
    first["ranged"]["value"] = first["ranged"]["value"][:-1]
    fresh, _ = build(sharded=True)
    with pytest.raises(ValueError, match=f"cover .* of parameter {first['index']!r}"):
        fsdp.load_model_shards(fresh, fsdp.whole_model_state(model), [pieces])


def test_the_run_handle_saves_a_scripts_fsdp2_model_and_optimizer_and_resumes_bit_for_bit(one_rank: None) -> None:
    """A script's own fully_shard model and optimizer registered with the run handle: the shared
    state keeps markers, each rank's file its rows, and a fresh registry continues exactly."""
    model, optimizer = build(sharded=True)
    train(model, optimizer, 3)
    registry = Registry({"model": model, "optimizer": optimizer})
    shared = copied(registry.shared_state())
    own = {"dtensor_pieces": copied(registry.dtensor_pieces())}
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
