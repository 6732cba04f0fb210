"""From a validated job to running ranks: local mpirun, Slurm through submitit, job arrays,
frozen code, and the hand-typed sbatch path (prepare). Reaches the rank side only through its
entry point, hpc.rank.main.

This package is also the Python API's `submit`: `from hpc import submit` imports it (a package's
submodule wins over any attribute of the same name once imported, so the package itself is the
callable), and `submit(...)` is hpc.submit.api.submit; `from hpc.submit import Job, SubmitError`
for what it returns and raises.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *overrides: str, **options: Any) -> Any:
        """hpc.submit.api.submit: launch.py from Python; the job, or a sweep's jobs."""
        from hpc.submit.api import submit

        return submit(*overrides, **options)


def __getattr__(name: str) -> Any:
    """Job and SubmitError (hpc.submit.api), loaded only when asked for."""
    if name in ("Job", "SubmitError"):
        from hpc.submit import api

        return getattr(api, name)
    raise AttributeError(f"module 'hpc.submit' has no attribute {name!r}")


sys.modules[__name__].__class__ = _CallablePackage
