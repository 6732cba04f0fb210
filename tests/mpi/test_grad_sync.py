"""Gradient sync per backend under real Open MPI, driven the way trainers/loop/fit.py drives it:
accumulation micro-steps do not communicate, and clipping and the grad scaler act on
gradients already averaged over ranks (tests/mpi/gradsync_worker.py)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import require
from tests.support.runs import ROOT, mpirun

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]


@pytest.mark.parametrize("backend", ["mpi", "gloo", "horovod"])
def test_micro_steps_stay_local_and_clipping_sees_the_average_over_ranks(backend):
    if backend == "horovod":  # under CI scripts/install.sh --cluster builds it: it must run
        require(importlib.util.find_spec("horovod") is not None, "Horovod (scripts/build-horovod.sh)")
    result = mpirun(2, str(ROOT / "tests" / "mpi" / "gradsync_worker.py"), backend)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"gradsync ok on {backend}, 2 ranks" in result.stdout
