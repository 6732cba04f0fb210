"""ZeRO stages 1 and 2 on ranks as threads (collectives/zero.py): the same training as replicated
data parallel, the optimizer state split over the ranks, its saved pieces resharded to another
world size and to and from a replicated optimizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from collectives.config import CommConfig
from collectives.optimizer import apply_distributed_optimizer
from collectives.testing import ThreadWorld
from collectives.zero import ShardingError, full_state, is_sharded, shard_optimizer
from tests.support.fit_in_process import builtin_task
from tests.support.fit_in_process import train as fit_in_process
from tests.support.runs import step_losses
from trainers.checkpoint.tensorfile import read_tensor_file
from trainers.config import CheckpointConfig, DataConfig, ModelConfig, OptimConfig, TrainerConfig
from trainers.context import FitConfig

STEPS = 6


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 1))


def make_optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(groups, lr=0.01)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 7, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train(
    world: int, sharding: str, steps: int = STEPS, bucket_mb: float = 0.0002, clip: float | None = 0.5, accumulation: int = 1, kind: str = "adamw"
) -> tuple[list[list[float]], list[torch.Tensor], list[dict]]:
    """Per-rank losses, rank 0's final parameters and every rank's saved shard."""

    def rank(comm: object) -> tuple[list[float], list[torch.Tensor], dict]:
        model = make_model()
        cfg = CommConfig(bucket_mb=bucket_mb, sharding=sharding)
        optimizer = make_optimizer(model, kind)
        # Made first, as a script does before the toolkit wraps its optimizer: the schedule's
        # wrapper holds the base class's step, which must run the sharded step all the same.
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        if sharding == "none":
            optimizer = apply_distributed_optimizer(optimizer, model, comm, cfg, accumulation)
        else:
            optimizer = shard_optimizer(optimizer, model, comm, cfg, {"optimizer": 1, "gradients": 2}[sharding], accumulation)
        losses = []
        for step in range(steps):
            for micro in range(accumulation):
                x, y = batch(step * accumulation + micro, comm.rank)  # type: ignore[attr-defined]
                loss = nn.functional.mse_loss(model(x), y)
                (loss / accumulation).backward()
            optimizer.synchronize()  # type: ignore[attr-defined]
            if clip is not None:
                if is_sharded(optimizer):
                    optimizer.clip_grad_norm_(clip)  # type: ignore[attr-defined]
                else:
                    nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        shard = optimizer.shard_state() if is_sharded(optimizer) else {}  # type: ignore[attr-defined]
        return losses, [p.detach().clone() for p in model.parameters()], shard

    results = ThreadWorld(world).run(rank)
    return [loss for r in results for loss in r[0]], results[0][1], [r[2] for r in results]


@pytest.mark.parametrize("sharding", ["optimizer", "gradients"])
@pytest.mark.parametrize("world", [2, 3])
def test_zero_trains_as_replicated_does(sharding: str, world: int) -> None:
    losses, params, _ = train(world, "none")
    assert len(losses) == world * STEPS
    sharded_losses, sharded_params, shards = train(world, sharding)
    assert sharded_losses == pytest.approx(losses, rel=1e-4, abs=1e-6)
    for mine, theirs in zip(sharded_params, params, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    initial = list(make_model().parameters())
    assert all((mine - before).abs().max() > 1e-3 for mine, before in zip(sharded_params, initial, strict=True))  # every parameter trained
    # Each rank holds about 1/world of the optimizer state, and together they hold all of it.
    total = sum(p.numel() for p in make_model().parameters())
    held = [sum(piece["stop"] - piece["start"] for piece in shard["pieces"]) for shard in shards]
    assert sum(held) == total
    assert max(held) <= total // world + 8 * 5  # a bucket's padding at most per bucket


def test_accumulation_and_sgd_with_momentum() -> None:
    losses, params, _ = train(2, "none", accumulation=2, kind="sgd", clip=None)
    sharded_losses, sharded_params, _ = train(2, "gradients", accumulation=2, kind="sgd", clip=None)
    assert sharded_losses == pytest.approx(losses, rel=1e-4, abs=1e-6)
    torch.testing.assert_close(sharded_params[0], params[0], rtol=1e-4, atol=1e-6)


def test_saved_pieces_reshard_to_another_world_size_and_to_a_replicated_optimizer() -> None:
    """Shards saved by 2 ranks (small buckets: parameters split between ranks) load into 3 ranks
    with other buckets, and assemble into a replicated optimizer's state, element for element."""
    _, params, shards = train(2, "gradients", steps=3)

    def load(comm: object) -> dict:
        model = make_model()
        with torch.no_grad():
            for p, saved in zip(model.parameters(), params, strict=True):
                p.copy_(saved)
        optimizer = shard_optimizer(make_optimizer(model), model, comm, CommConfig(bucket_mb=0.0001, sharding="optimizer"), 1)
        optimizer.load_shard_state(iter(shards))  # type: ignore[attr-defined]
        return optimizer.shard_state()  # type: ignore[attr-defined]

    resharded = ThreadWorld(3).run(load)
    model = make_model()
    plain = make_optimizer(model)
    before = full_state(plain, shards)
    after = full_state(plain, resharded)
    assert sorted(before) == sorted(after) == list(range(len(list(model.parameters()))))
    for index, state in before.items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in state.items():
            assert torch.equal(value, after[index][key]), (index, key)
        in_groups = [p for group in plain.param_groups for p in group["params"]]
        assert state["exp_avg"].shape == in_groups[index].shape
    # And into a replicated optimizer through its own load_state_dict.
    plain.load_state_dict({"state": before, "param_groups": plain.state_dict()["param_groups"]})
    assert torch.equal(plain.state_dict()["state"][0]["exp_avg_sq"], before[0]["exp_avg_sq"])


def test_a_replicated_state_loads_into_shards() -> None:
    model = make_model()
    plain = make_optimizer(model)
    nn.functional.mse_loss(model(batch(0, 0)[0]), batch(0, 0)[1]).backward()
    plain.step()
    saved = plain.state_dict()

    def load(comm: object) -> dict:
        shard_optimizer(make_optimizer(make_model()), make_model(), comm, CommConfig(sharding="optimizer"), 1)
        return {"ok": True}

    with pytest.raises(ShardingError, match="not the model's"):
        ThreadWorld(2).run(load)

    def load_right(comm: object) -> dict:
        fresh = make_model()
        sharded = shard_optimizer(make_optimizer(fresh), fresh, comm, CommConfig(bucket_mb=0.0001, sharding="gradients"), 1)
        sharded.load_state_dict(saved)
        assert not sharded.state  # the outer optimizer keeps no state: the shard is the inner one's
        return sharded.shard_state()  # type: ignore[attr-defined]

    shards = ThreadWorld(2).run(load_right)
    rebuilt = full_state(plain, shards)
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(rebuilt[index][key], value)


def test_refusals() -> None:
    model = make_model()
    lbfgs = torch.optim.LBFGS(model.parameters())
    world = ThreadWorld(1)
    with pytest.raises(ShardingError, match="elementwise.*LBFGS is not one"):
        shard_optimizer(lbfgs, model, world.ranks[0], CommConfig(sharding="optimizer"), 1)


def test_a_model_smaller_than_the_world_still_trains() -> None:
    """A single scalar parameter over 3 ranks: two ranks own nothing and only gather."""

    def rank(comm: object) -> float:
        torch.manual_seed(0)
        weight = nn.Parameter(torch.tensor([2.0]))
        model = nn.ParameterList([weight])
        optimizer = shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm, CommConfig(sharding="gradients"), 1)
        for _ in range(3):
            (weight**2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return float(weight.detach())

    assert ThreadWorld(3).run(rank) == [pytest.approx(2.0 * 0.8**3)] * 3


# --- the built-in loop (fit) with sharded state and sharded checkpoints, on thread ranks ----------


def fit_config(sharding: str, max_steps: int, **trainer: object) -> FitConfig:
    return FitConfig(
        model=ModelConfig(hidden_sizes=[32, 16]),  # no dropout: thread ranks share torch's global RNG
        data=DataConfig(batch_size=32),
        optim=OptimConfig(name="adamw", lr=0.01),
        trainer=dataclasses.replace(TrainerConfig(), epochs=1, max_steps=max_steps, watchdog_s=None, clip_grad_norm=0.5, **trainer),
        comm=CommConfig(bucket_mb=0.002, sharding=sharding),  # small buckets: parameters split between ranks
        checkpoint=CheckpointConfig(every_steps=2, every_minutes=None, keep=3),
    )


def fit_ranks(run_dir: Path, ranks: int, sharding: str, stop_at: int | None = None, **trainer: object) -> list[float]:
    """fit() on thread ranks to step 6, stopped (as by a signal) after `stop_at`; the per-step
    losses of the whole run dir so far."""
    cfg = fit_config(sharding, 6, **trainer)
    ThreadWorld(ranks).run(lambda comm: fit_in_process(run_dir, builtin_task(cfg), cfg, comm, stop_at=stop_at))
    return [loss for _, loss in sorted(step_losses(run_dir).items())]


@pytest.mark.parametrize("sharding", ["optimizer", "gradients"])
def test_fit_sharded_resumes_exactly_and_reshards_two_three_two(tmp_path: Path, sharding: str) -> None:
    # Exact resume at the same world size: stopped at step 3, resumed to 6, as a run straight to 6.
    straight = fit_ranks(tmp_path / "straight", 2, sharding)
    fit_ranks(tmp_path / "cut", 2, sharding, stop_at=3)  # the stop's own save: not on the every-2-steps grid
    assert fit_ranks(tmp_path / "cut", 2, sharding) == straight
    newest = tmp_path / "cut" / "checkpoints" / "step-000000006"
    shards = [read_tensor_file(path)["optimizer_shards"]["optimizer"]["pieces"] for path in sorted(newest.glob("rank-*.ckpt"))]
    assert len(shards) == 2 and all(shards)  # every rank wrote its own part of the optimizer state
    assert not read_tensor_file(newest / "shared.ckpt")["state"]["optimizer"]["state"]
    # 2 -> 3 -> 2 ranks, as replicated training does on the same world sizes.
    for run, mode in (("sharded", sharding), ("replicated", "none")):
        for ranks, until in ((2, 2), (3, 4)):
            fit_ranks(tmp_path / run, ranks, mode, stop_at=until)
    sharded, replicated = fit_ranks(tmp_path / "sharded", 2, sharding), fit_ranks(tmp_path / "replicated", 2, "none")
    assert len(sharded) == 6
    assert sharded == pytest.approx(replicated, rel=1e-4, abs=1e-6)
    assert sharded[3] != sharded[0]


def test_fit_switches_between_replicated_and_sharded_checkpoints(tmp_path: Path) -> None:
    """A replicated checkpoint resumes sharded and a sharded one replicated, as if never switched."""
    fit_ranks(tmp_path / "switched", 2, "none", stop_at=2)
    fit_ranks(tmp_path / "switched", 3, "gradients", stop_at=4)
    switched = fit_ranks(tmp_path / "switched", 2, "none")
    fit_ranks(tmp_path / "plain", 2, "none", stop_at=2)
    fit_ranks(tmp_path / "plain", 3, "none", stop_at=4)
    plain = fit_ranks(tmp_path / "plain", 2, "none")
    assert switched == pytest.approx(plain, rel=1e-4, abs=1e-6)


def test_fit_sharded_with_bf16_autocast_and_accumulation_trains_as_replicated(tmp_path: Path) -> None:
    features = {"precision": "bf16", "accumulation_steps": 2}
    sharded = fit_ranks(tmp_path / "sharded", 2, "gradients", **features)
    replicated = fit_ranks(tmp_path / "replicated", 2, "none", **features)
    assert len(sharded) == 6 and sharded == pytest.approx(replicated, rel=2e-3)
    assert sharded != fit_ranks(tmp_path / "fp32", 2, "gradients")  # bf16 autocast did run


# --- a checkpoint of the built-in loop's layout before the one registry (trainers.checkpoint.legacy) ---

LEGACY = Path(__file__).parent.parent / "fixtures" / "checkpoints" / "loop-layout-1"


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_checkpoint_of_the_loop_layout_before_the_registry_resumes_exactly(tmp_path: Path, ranks: int) -> None:
    """Step 4 of a ZeRO-1 run on two thread ranks, written by the version before the registry
    (a61eb3b; its uninterrupted run's losses and step-6 weights kept beside it): resumed by this
    version on two ranks it gives the same losses and weights bit for bit; on one rank (its
    optimizer shards assembled from both files) it resumes at step 4 and trains on."""
    import json
    import shutil

    shutil.copytree(LEGACY / "checkpoints", tmp_path / "run" / "checkpoints")
    old = json.loads((LEGACY / "uninterrupted.json").read_text())["losses"]
    losses = fit_ranks(tmp_path / "run", ranks, "optimizer")
    assert len(losses) == 2  # steps 5 and 6: resumed at 4, nothing re-run
    if ranks == 1:
        return
    assert losses == old[4:]
    newest = read_tensor_file(tmp_path / "run" / "checkpoints" / "step-000000006" / "shared.ckpt")
    expected = read_tensor_file(LEGACY / "step-6-shared.ckpt")["model"]
    assert sorted(newest["state"]["model"]) == sorted(expected)
    assert all(torch.equal(newest["state"]["model"][name], value) for name, value in expected.items())


def test_a_sharded_model_of_the_old_layout_is_refused_in_one_line() -> None:
    from trainers.checkpoint.checkpointer import CheckpointError
    from trainers.checkpoint.legacy import from_loop_layout

    old = read_tensor_file(LEGACY / "checkpoints" / "step-000000004" / "shared.ckpt")
    assert from_loop_layout(4, old)["sharded"] == ["optimizer"]
    refused = r"^checkpoint step 4 was written with comm.sharding=full in the built-in loop's layout 1 .*; resume it with the version that wrote it"
    with pytest.raises(CheckpointError, match=refused):
        from_loop_layout(4, {**old, "model_sharded": True})
