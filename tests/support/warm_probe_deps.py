"""Imported by the test warm process before it listens (tests/unit/test_warm.py): the probe's imports."""

import hpc.rank.warm  # noqa: F401
