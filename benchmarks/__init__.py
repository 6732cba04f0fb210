"""Benchmarks: each module is a script (`python benchmarks/NAME.py`); `simcluster` is shared with the tests."""
