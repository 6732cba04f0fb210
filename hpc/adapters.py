"""What the framework adapters (hpc.lightning, hpc.hf) share: a framework's optimizer steps
counted into the run handle, and which of its logged values are figures the run keeps."""

from __future__ import annotations

from typing import Any

import torch

from hpc.run import Run


def end_steps_until(run: Run, step: int, metrics: dict[str, Any]) -> bool:
    """end_step() for each optimizer step the framework took since the run handle last counted
    (one, unless accumulation or a deferred vote left some), `metrics` with the last; True: stop
    now (saved)."""
    while run.step < step:
        if run.end_step(**(metrics if run.step + 1 == step else {})):
            return True
    return False


def numeric(value: Any) -> bool:
    """A number run.log() takes: an int or float (not a bool), or a one-element tensor."""
    return isinstance(value, int | float) and not isinstance(value, bool) or isinstance(value, torch.Tensor) and value.numel() == 1
