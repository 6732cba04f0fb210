"""A stand-in for a framework a script imports (Lightning, transformers), imported by the test
warm process when its environment names it (tests/unit/test_warm.py)."""
