"""One trainer, several backends: from the same seed and data, 20 steps on 2 ranks end with
the same parameters whichever backend reduced the gradients (float32 sums in a different order
differ in the last bits: tolerance 1e-5 absolute), and 1 rank with the global batch equals
2 ranks with half of it each."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.conftest import IN_CI, require
from tests.support.runs import run_dirs, run_launch
from trainers.checkpoint import load_tensor_file

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]
STEPS = ["trainer.max_steps=20", "trainer.epochs=2", "optim.lr=0.2", "checkpoint.every_steps=0"]
TOLERANCE = 1e-5


def final_parameters(tmp_path: Path, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    where = tmp_path / name
    where.mkdir()
    done = run_launch(*STEPS, *overrides, cwd=where)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = run_dirs(where)
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    steps = next((int(o.split("=")[1]) for o in reversed(overrides) if o.startswith("trainer.max_steps=")), 20)
    assert newest.name == f"step-{steps:09d}"
    return load_tensor_file(newest / "shared.ckpt")["model"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def backends() -> list[str]:
    names = ["gloo"]
    if importlib.util.find_spec("horovod") is not None or IN_CI:
        names.append("horovod")  # under CI scripts/install.sh --cluster builds it: it must run
    return names


@pytest.mark.parametrize("backend", backends())
def test_every_cpu_backend_trains_to_the_same_parameters_as_ours(tmp_path, backend):
    if backend == "horovod":
        require(importlib.util.find_spec("horovod") is not None, "Horovod (scripts/build-horovod.sh)")
    ours = final_parameters(tmp_path, "mpi", "comm=mpi")
    theirs = final_parameters(tmp_path, backend, f"comm={backend}")
    assert max_difference(ours, theirs) < TOLERANCE
    untrained_gap = max_difference(ours, final_parameters(tmp_path, "fewer", "comm=mpi", "trainer.max_steps=19"))
    assert untrained_gap > 100 * TOLERANCE  # the comparison can tell one step apart


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_one_rank_with_the_global_batch_equals_two_ranks_with_half(tmp_path, backend):
    two = final_parameters(tmp_path, "two", f"comm={backend}", "resources.tasks_per_node=2", "data.batch_size=32")
    one = final_parameters(tmp_path, "one", f"comm={backend}", "resources.tasks_per_node=1", "data.batch_size=64")
    assert max_difference(one, two) < TOLERANCE


def test_a_global_batch_gives_the_same_training_on_one_or_two_ranks(tmp_path):
    """trainer.global_batch=64 with batch 32: 2 accumulation steps on 1 rank, 1 on 2 ranks."""
    common = ("comm=mpi", "trainer.global_batch=64", "data.batch_size=32")
    one = final_parameters(tmp_path, "one", *common, "resources.tasks_per_node=1")
    two = final_parameters(tmp_path, "two", *common, "resources.tasks_per_node=2")
    assert max_difference(one, two) < TOLERANCE


def test_fp16_training_checkpoints_its_loss_scale(tmp_path):
    where = tmp_path / "fp16"
    where.mkdir()
    done = run_launch("trainer.max_steps=5", "trainer.precision=fp16", "trainer.clip_grad_norm=1.0", cwd=where)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = run_dirs(where)
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert load_tensor_file(newest / "shared.ckpt")["scaler"]["scale"] > 0
