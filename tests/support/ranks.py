"""A fixture for in-process tests of rank code: the test process is one rank of a world of one."""

from __future__ import annotations

import os

import pytest

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher's variables (mpirun's, srun's, torchrun's) reach the code under test."""
    for name in [n for n in os.environ if n.startswith(("OMPI_", "PMIX_", "SLURM_")) or n in LAUNCHER_VARIABLES]:
        monkeypatch.delenv(name)
