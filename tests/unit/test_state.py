"""What a bit-exact continuation keeps (trainers.checkpoint.state): the random streams the run handle
promises (Python, NumPy, torch; CUDA where there is one), where training stands (Progress),
and the shared state a checkpoint holds and gives back: model, optimizer, schedule, loss scale,
config. Each piece is saved, disturbed, restored and compared."""

from __future__ import annotations

import random
from dataclasses import asdict

import numpy as np
import pytest
import torch
from torch import nn

from trainers.checkpoint.checkpointer import CheckpointError
from trainers.checkpoint.registry import Registry, own_checkpoint, restore_checkpoint, shared_checkpoint
from trainers.checkpoint.state import LossScale, Progress, check_compatible, restore_rng, rng_state


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


@pytest.fixture
def streams_kept():
    """The test's draws must not move the process's streams for the tests after it."""
    kept = rng_state()
    yield
    restore_rng(kept)


def test_every_stream_continues_where_it_was_saved(streams_kept):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    draws()
    saved = rng_state()
    assert set(saved) == ({"python", "numpy", "torch", "cuda"} if torch.cuda.is_available() else {"python", "numpy", "torch"})
    assert all(isinstance(part, torch.Tensor) or not isinstance(part, np.ndarray) for part in saved["numpy"])  # no pickled arrays
    expected = [draws() for _ in range(3)]
    random.seed(9), np.random.seed(9), torch.manual_seed(9)  # another run's streams
    restore_rng(saved)
    assert [draws() for _ in range(3)] == expected


@pytest.mark.parametrize("stream", ["python", "numpy", "torch"])
def test_each_stream_is_restored_on_its_own(streams_kept, stream):
    """Every stream is its own: a restore that left one out would continue it from wherever it is."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = rng_state()
    index = ["python", "numpy", "torch"].index(stream)
    expected = draws()[index]
    draws(), draws()  # move every stream on
    restore_rng(saved)
    assert draws()[index] == expected


def test_numpys_state_keeps_its_exact_key_and_position(streams_kept):
    np.random.seed(12345)
    np.random.rand(7)  # a position inside the key array and a cached gaussian
    np.random.standard_normal()
    before = np.random.get_state()
    restore_rng(rng_state())
    after = np.random.get_state()
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and before[1].dtype == after[1].dtype == np.uint32
    assert tuple(before[2:]) == tuple(after[2:])


def test_a_new_epoch_starts_its_counts_over_and_keeps_the_runs():
    progress = Progress(
        step=40,
        epoch=2,
        position=640,
        epoch_loss_sum=3.5,
        epoch_seen=640,
        epoch_steps=10,
        epoch_seconds=2.0,
        train_seconds=9.0,
        bad_steps=2,
        rollbacks=1,
        skip=[[1, 0, 64]],
    )
    progress.next_epoch()
    assert asdict(progress) == {
        "step": 40,
        "epoch": 3,
        "position": 0,
        "epoch_loss_sum": 0.0,
        "epoch_seen": 0,
        "epoch_steps": 0,
        "epoch_seconds": 0.0,
        "train_seconds": 9.0,
        "bad_steps": 2,
        "rollbacks": 1,
        "skip": [[1, 0, 64]],
    }
    fresh = asdict(Progress())
    assert fresh == {**{key: 0 for key in fresh}, "epoch": 1, "skip": []}  # a new run counts from nothing, in its first epoch
    assert Progress().skip is not Progress().skip  # no list shared between runs


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        optimizer.step()
        schedule.step()
    return model, optimizer, schedule


def loop_state(model: nn.Module, optimizer: torch.optim.Optimizer, schedule: object, progress: Progress, scaler: object = None) -> Registry:
    """What the built-in loop registers (trainers.loop.build.loop_registry)."""
    return Registry({"model": model, "optimizer": optimizer, "schedule": schedule, "scaler": LossScale(scaler), "progress": progress})


def saved(registry: Registry, step: int = 3) -> tuple[dict, dict]:
    return shared_checkpoint(registry, step, 1, "model: mlp\n", {"task": "mlp-task", "name": "mlp"}), own_checkpoint(registry)


def resume(registry: Registry, shared: dict, own: dict | None, step: int = 3) -> None:
    restore_checkpoint(registry, step, shared, own, lambda: iter([own or {}]), "mlp-task")


def test_the_shared_state_holds_what_a_resume_needs_and_gives_it_back(streams_kept):
    model, optimizer, schedule = trained(0)
    progress = Progress(step=3, epoch=1, position=48, bad_steps=1)
    state, own = saved(loop_state(model, optimizer, schedule, progress))
    assert (state["config"], state["model_config"], state["state"]["progress"], state["state"]["scaler"]) == (
        "model: mlp\n",
        {"task": "mlp-task", "name": "mlp"},
        asdict(progress),
        {},
    )
    assert state["registry"]["state"] == ["model", "optimizer", "progress", "scaler", "schedule"] and state["sharded"] == []
    assert state["state"]["schedule"]["last_epoch"] == 3 and state["state"]["optimizer"]["state"]  # Adam's moments, whole

    other, other_optimizer, other_schedule = trained(1)
    resumed = Progress()
    resume(loop_state(other, other_optimizer, other_schedule, resumed), state, own)
    assert resumed == progress and resumed is not progress
    for name, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name  # BatchNorm's running statistics too
    assert other_schedule.state_dict() == schedule.state_dict() and other_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    for mine, theirs in zip(optimizer.state_dict()["state"].values(), other_optimizer.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(mine[key], theirs[key]) for key in mine)


def test_a_checkpoint_of_another_model_or_task_is_refused_before_anything_is_loaded():
    model, optimizer, schedule = trained(0)
    state, own = saved(loop_state(model, optimizer, schedule, Progress(step=3)))
    wider = nn.Sequential(nn.Linear(4, 9), nn.BatchNorm1d(9), nn.Linear(9, 2))
    before = {name: value.clone() for name, value in wider.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"checkpoint step 3 does not fit this model: 0.bias is \(8,\) there and \(9,\) here; use a new run dir"):
        resume(loop_state(wider, torch.optim.AdamW(wider.parameters()), schedule, Progress()), state, own)
    assert all(torch.equal(wider.state_dict()[name], value) for name, value in before.items())
    with pytest.raises(CheckpointError, match=r"checkpoint step 3 was written by task mlp-task, not other-task; use a new run dir"):
        restore_checkpoint(loop_state(model, optimizer, schedule, Progress()), 3, state, own, lambda: iter([own]), "other-task")
    with pytest.raises(CheckpointError, match=r"'3.bias' is missing from the checkpoint"):
        check_compatible(nn.Sequential(*model, nn.Linear(2, 2)), model.state_dict(), 5)
    with pytest.raises(CheckpointError, match=r"'2.bias' is missing from this model"):
        check_compatible(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2, bias=False)), model.state_dict(), 5)


def test_the_loss_scale_is_restored_only_into_a_scaler_in_use():
    model, optimizer, schedule = trained(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=96.0)
    state, own = saved(loop_state(model, optimizer, schedule, Progress(step=3), scaler))
    assert state["state"]["scaler"]["scale"] == 96.0
    fresh = torch.amp.GradScaler("cpu")
    resume(loop_state(model, optimizer, schedule, Progress(), fresh), state, own)
    assert fresh.get_scale() == 96.0
    off = torch.amp.GradScaler("cpu", enabled=False)
    resume(loop_state(model, optimizer, schedule, Progress(), off), state, own)  # fp32 now: nothing to restore into
    assert not off.is_enabled()
    without, own = saved(loop_state(model, optimizer, schedule, Progress(step=3), off))
    assert without["state"]["scaler"] == {}
    fresh = torch.amp.GradScaler("cpu", init_scale=512.0)
    resume(loop_state(model, optimizer, schedule, Progress(), fresh), without, own)  # an fp32 checkpoint resumed in fp16: the scale starts afresh
    assert fresh.get_scale() == 512.0


def test_zero_optimizer_shards_resume_on_another_world_size_from_every_ranks_files(tmp_path):
    """ZeRO-1 on two thread ranks saves each rank's half of the optimizer state in its own file;
    resumed on one rank, the state is assembled from both files (no own file of the same world
    size to take it from) and training continues from the checkpoint as one rank."""
    import dataclasses

    from collectives.config import CommConfig
    from collectives.testing import ThreadWorld
    from tests.support.fit_in_process import builtin_task, config, train

    cfg = config(max_steps=4, every_steps=4)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="adamw", lr=1e-3), comm=CommConfig(backend="mpi", sharding="optimizer"))
    ThreadWorld(2).run(lambda comm: train(tmp_path, builtin_task(cfg), cfg, comm))
    assert sorted(path.name for path in (tmp_path / "checkpoints").glob("step-*4/rank-*.ckpt")) == ["rank-00000.ckpt", "rank-00001.ckpt"]
    longer = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=6), comm=CommConfig(backend="mpi"))
    result = train(tmp_path, builtin_task(longer), longer)
    assert (result.resumed_from, result.steps) == (4, 6)


def test_a_model_saved_in_fsdp2_rows_resumes_whole(tmp_path):
    """FSDP2's checkpoint keeps the parameters' rows in the ranks' files (shared.ckpt has only
    the buffers): a resume without sharding assembles them, and checks no whole model against
    shared.ckpt's partial one."""
    import dataclasses

    import torch.distributed

    from collectives.config import CommConfig
    from collectives.torchdist import TorchDistCollectives
    from tests.support.fit_in_process import builtin_task, config, train
    from tests.support.ranks import gloo_world_of_one

    cfg = dataclasses.replace(config(max_steps=4, every_steps=4), comm=CommConfig(backend="gloo", sharding="full"))
    whole = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=6), comm=CommConfig(backend="gloo"))
    with gloo_world_of_one(tmp_path / "store"):
        one_rank = TorchDistCollectives("gloo", torch.device("cpu"))
        train(tmp_path / "run", builtin_task(cfg), cfg, one_rank)
        assert torch.distributed.is_initialized()
        result = train(tmp_path / "run", builtin_task(whole), whole, one_rank)
    assert (result.resumed_from, result.steps) == (4, 6)
