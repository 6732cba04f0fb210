"""Activation checkpointing: chosen modules keep only their inputs in forward and run again in
backward (torch.utils.checkpoint, non-reentrant: autocast and the RNG state are replayed, so a
run with it is bit-identical to one without)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainers.task import TaskError


def _recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation keeps no activations anyway
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def recompute_in_backward(modules: Sequence[nn.Module]) -> None:
    """Make each module's forward keep no activations; refuse modules whose forward updates
    buffers (running statistics), which a second forward would update twice."""
    for module in modules:
        stateful = next((m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats), None)
        if stateful is not None:
            raise TaskError(
                f"activation checkpointing of a {type(module).__name__}: its {type(stateful).__name__} updates running statistics in forward, "
                "which recomputation would do twice; name modules without batch norm"
            )
        module.forward = functools.partial(_recomputed, module.forward)  # the instance's forward shadows the class's
