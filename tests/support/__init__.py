"""Helpers shared by the tests (never test modules themselves; benchmarks never import them)."""
