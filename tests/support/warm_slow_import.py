"""A module whose import takes a second (tests/unit/test_warm.py: clients come while the warm process imports)."""

import time

time.sleep(1.0)
