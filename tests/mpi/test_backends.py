"""One trainer, several backends: from the same seed and data, 20 steps (at a constant lr, so the
last step moves the parameters as much as the first) on 2 ranks end with
the same parameters whichever backend reduced the gradients (float32 sums in a different order
differ in the last bits: tolerance 1e-5 absolute), and so does 1 rank with the global batch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.conftest import IN_CI, require
from tests.support.runs import fixtures_env, run_dirs, run_launch
from trainers.checkpoint.checkpointer import load_tensor_file

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]
STEPS = ["trainer.max_steps=20", "trainer.epochs=2", "optim.lr=0.2", "optim.schedule=constant", "checkpoint.every_steps=19"]
TOLERANCE = 1e-5
# A user's task from a package outside the toolkit (tests/fixtures/mytasks), on PYTHONPATH
USER_TASK = ("task._target_=mytasks.regression.Regression", "+task.hidden=32", "+task.samples=2048")
TASKS = {"builtin": (), "user-task": USER_TASK}


def checkpoints(tmp_path: Path, name: str, *overrides: str) -> dict[int, dict]:
    """Train in tmp_path/name; every committed checkpoint's shared state by step."""
    where = tmp_path / name
    where.mkdir()
    done = run_launch(*overrides, cwd=where, env=fixtures_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = run_dirs(where)
    return {int(d.name.removeprefix("step-")): load_tensor_file(d / "shared.ckpt")["state"] for d in sorted((run_dir / "checkpoints").glob("step-*"))}


def final_parameters(tmp_path: Path, name: str, *overrides: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The parameters after 20 steps, and after 19 of the same run (the guard: equality within
    TOLERANCE means something only where one step moves the parameters by far more)."""
    saved = checkpoints(tmp_path, name, *STEPS, *overrides)
    assert sorted(saved) == [19, 20]
    return saved[20]["model"], saved[19]["model"]


def assert_one_step_apart_is_noticed(last: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    assert max_difference(last, before) > 100 * TOLERANCE


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def backends(task: str) -> list[str]:
    """The other backends on the built-in task only: their gradient sync does not depend on the
    task (the user's task meets Gloo as one rank with the global batch), and each launch costs
    15-30 s of suite time."""
    if task != "builtin":
        return []
    names = ["gloo"]
    if importlib.util.find_spec("horovod") is not None or IN_CI:
        names.append("horovod")  # under CI scripts/install.sh --cluster builds it: it must run
    return names


# Clipping tight enough to act on every step, and a global batch of 64 from batches of 32: the
# clipped gradient must be the global batch's (averaged over ranks and micro-batches), never a
# rank's or a micro-batch's own, whichever backend reduced it and however many ranks took part.
COMMON = ("trainer.global_batch=64", "data.batch_size=32", "trainer.clip_grad_norm=0.05")


# Ours trains once per task; every other backend, and one rank taking the global batch in two
# accumulation steps (on ours for the built-in task, Gloo for the user's), is compared with it.
@pytest.mark.parametrize("task", TASKS)
def test_every_cpu_backend_and_one_rank_with_the_global_batch_train_to_the_same_parameters_as_ours(tmp_path, task):
    ours, ours_before = final_parameters(tmp_path, "mpi", "comm=mpi", *COMMON, *TASKS[task])
    assert_one_step_apart_is_noticed(ours, ours_before)
    alone = "mpi" if task == "builtin" else "gloo"
    one_rank, _ = final_parameters(tmp_path, "one-rank", f"comm={alone}", *COMMON, *TASKS[task], "resources.tasks_per_node=1")
    assert max_difference(ours, one_rank) < TOLERANCE, f"one rank on {alone}"
    for backend in backends(task):
        if backend == "horovod":
            require(importlib.util.find_spec("horovod") is not None, "Horovod (scripts/build-horovod.sh)")
        theirs, _ = final_parameters(tmp_path, backend, f"comm={backend}", *COMMON, *TASKS[task])
        assert max_difference(ours, theirs) < TOLERANCE, backend


def test_fp16_training_checkpoints_its_loss_scale(tmp_path):
    """A checkpoint every step: each step's scale follows GradScaler's rule from its default
    2**16 (halve on a skipped step, whose parameters stay as they were; double after
    growth_interval good steps in a row), and the growth tracker counts the good steps."""
    steps = 5
    saved = checkpoints(
        tmp_path,
        "fp16",
        f"trainer.max_steps={steps}",
        "trainer.precision=fp16",
        "trainer.clip_grad_norm=1.0",
        "checkpoint.every_steps=1",
        f"checkpoint.keep={steps + 1}",
    )
    assert sorted(saved) == list(range(1, steps + 1))
    default = torch.amp.GradScaler("cpu")
    scale, tracker, interval = default.get_scale(), 0, default.get_growth_interval()
    updated = []
    for step in range(1, steps + 1):
        state = saved[step]["scaler"]
        if step == 1:
            skipped = state["_growth_tracker"] == 0  # no checkpoint before the first step
        else:
            skipped = max_difference(saved[step]["model"], saved[step - 1]["model"]) == 0
        updated += [] if step == 1 else [not skipped]  # step 1's own verdict comes from its checkpoint: not counted
        scale, tracker = (scale * default.get_backoff_factor(), 0) if skipped else (scale, tracker + 1)
        if tracker == interval:
            scale, tracker = scale * default.get_growth_factor(), 0
        assert (state["scale"], state["_growth_tracker"]) == (scale, tracker), (step, skipped)
    assert any(updated), "every step overflowed: the rule above was never checked on a step that trained"
