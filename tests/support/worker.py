"""Entry for scripts run on every rank under mpirun (tests/mpi/*_worker.py)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable


def run_worker(main: Callable[[], object]) -> None:
    """Run `main`; a rank that fails prints its traceback and exits at once with 1, so one rank
    failing alone does not leave the others waiting in a collective until the test's timeout."""
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
