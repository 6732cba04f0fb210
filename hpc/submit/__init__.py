"""From a validated job to running ranks: local mpirun, Slurm through submitit, job arrays,
frozen code, and the hand-typed sbatch path (prepare). Reaches the rank side only through its
entry point, hpc.rank.main.

This package is also the Python API's `submit`: `from hpc import submit` imports it (a package's
submodule wins over any attribute of the same name once imported, so the package itself is the
callable), and `submit(...)` is hpc.api.submit.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *overrides: str, **options: Any) -> Any:
        """hpc.api.submit: launch.py from Python; the job, or a sweep's jobs."""
        from hpc.api import submit

        return submit(*overrides, **options)


sys.modules[__name__].__class__ = _CallablePackage
