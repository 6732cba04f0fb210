"""A fixture for in-process tests of rank code: the test process is one rank of a world of one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher's variables (mpirun's, srun's, torchrun's) reach the code under test."""
    for name in [n for n in os.environ if n.startswith(("OMPI_", "PMIX_", "SLURM_")) or n in LAUNCHER_VARIABLES]:
        monkeypatch.delenv(name)


@contextmanager
def gloo_world_of_one(store: Path) -> Iterator[None]:
    """torch.distributed's default group on Gloo with this process its only rank (a file store)."""
    import torch.distributed as dist  # here: most tests that take the fixture above never need torch

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
