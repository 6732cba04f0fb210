"""Numbers as a person reads them in the launcher's lines, hpc.status and hpc.report. Runs keep
the exact values (an override's text is what the job composed); only what is printed is short."""

from __future__ import annotations

import math


def shown_value(text: str) -> str:
    """A swept value: a float written with many digits (Optuna's 0.0012345678901234567, a range's
    0.30000000000000004) in 4 significant digits; anything else (ints, names, short floats) as written."""
    if "." not in text or len(text) <= 8:
        return text
    try:
        number = float(text)
    except ValueError:
        return text
    return f"{number:.4g}" if math.isfinite(number) else text


def shown_override(override: str) -> str:
    """`optim.lr=0.0012345678901234567` -> `optim.lr=0.001235`."""
    key, equals, value = override.partition("=")
    return f"{key}={shown_value(value)}" if equals else override
