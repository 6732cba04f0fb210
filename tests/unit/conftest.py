"""Fixtures shared by the unit tests of warm ranks and parking (tests/unit/test_warm.py, tests/unit/test_parking.py)."""

from tests.support.warmserver import job_env, warm  # noqa: F401 - fixtures
