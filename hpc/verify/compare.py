"""What the resume verifier compares: two runs' per-step losses, and every tensor and counter of
their final checkpoints (parameters, every rank's buffers, optimizer and scaler state, RNG
streams, the data position), bit for bit. Pure functions over loaded states, and one reader of a
run dir's newest checkpoint."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Wall-clock figures and the config text (it names the run dir): the only things two exact runs
# may hold differently in their checkpoints. Hugging Face's log history names its timings
# eval_runtime, train_samples_per_second...: by their endings.
IGNORED = frozenset({"epoch_seconds", "train_seconds", "config"})
IGNORED_ENDINGS = ("_runtime", "_per_second")
# Buffers known by name where a checkpoint does not list them (one written before ranks kept their own).
BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """`obj` as {dotted path: leaf}: dicts by key, lists and tuples by index."""
    if isinstance(obj, dict):
        flat: dict[str, Any] = {}
        for key, value in obj.items():
            if str(key) not in IGNORED and not str(key).endswith(IGNORED_ENDINGS):
                flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(obj, list | tuple):
        flat = {}
        for i, value in enumerate(obj):
            flat.update(flatten(value, f"{prefix}[{i}]"))
        return flat
    return {prefix: obj}


def same_leaf(a: Any, b: Any) -> bool:
    """Bit for bit: tensors by dtype, shape and bytes (NaN equals NaN); numbers exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8), b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(type(a) is type(b) and a == b)


@dataclass(frozen=True)
class StateDiff:
    """How two final states compare: how many leaves were compared, and the ones that differ."""

    compared: int
    tensors: int
    differing: list[str]


def compare_states(reference: dict[str, Any], resumed: dict[str, Any]) -> StateDiff:
    """Every leaf of two flattened states; a leaf only one of them has differs too."""
    names = sorted(set(reference) | set(resumed))
    differing = [name for name in names if name not in reference or name not in resumed or not same_leaf(reference[name], resumed[name])]
    tensors = sum(isinstance(value, torch.Tensor) for value in reference.values())
    return StateDiff(len(names), tensors, differing)


Losses = dict[int, tuple[tuple[str, float], ...]]  # per step: every figure named *loss*, sorted by name


def first_divergence(reference: Losses, resumed: Losses) -> int | None:
    """The first step whose losses differ (or that only one run logged); None: all alike."""
    for step in sorted(set(reference) | set(resumed)):
        a, b = reference.get(step), resumed.get(step)
        if a is None or b is None or [k for k, _ in a] != [k for k, _ in b]:
            return step
        if not all(same_leaf(float(x), float(y)) for (_, x), (_, y) in zip(a, b, strict=True)):
            return step
    return None


def kind_of(name: str, buffers: Iterable[str]) -> str:
    """What a differing leaf is, in the words of the hint: a buffer, a parameter, optimizer state ..."""
    leaf = name.split(":", 1)[-1].removeprefix("state.")  # the registry's shared state: state.<registered name>...
    if leaf.startswith("rng") or ".rng" in leaf:
        return "an RNG stream"
    if leaf.startswith("buffers.") or any(leaf.endswith(b) for b in buffers) or leaf.rsplit(".", 1)[-1] in BUFFER_NAMES:
        return "a buffer"
    if "optimizer" in leaf or leaf.startswith("optim"):
        return "optimizer state"
    if leaf.startswith("scaler") or ".scaler" in leaf:
        return "the grad scaler"
    if leaf.startswith(("progress", "values", "schedule")):
        return "a counter or value"
    return "a parameter or registered state"


HINTS = {
    "a buffer": "a buffer (BatchNorm running statistics, anything registered with register_buffer) is not what the step left it",
    "an RNG stream": "an RNG stream differs: something draws random numbers outside the registered streams, or a different number of times after a resume",
    "optimizer state": "the optimizer's state differs: a step updated it after the save, or it was not restored",
    "the grad scaler": "the grad scaler's state (loss scale, growth tracker) was not restored",
    "a counter or value": "a counter or registered value differs",
    "a parameter or registered state": "the weights differ",
}


def hint(first_step: int | None, resumes: list[int], kinds: list[str]) -> str:
    """Why, most likely: by the first differing step's place after a resume, and by the kinds of
    tensors that differ."""
    after = [r for r in resumes if first_step is not None and r < first_step]
    if first_step is not None and after and first_step == after[-1] + 1:
        return (
            f"the first step after the resume from step {after[-1]} differs: something that step uses was not restored as it was: a batch "
            "drawn ahead from a generator the run does not register (torch's global generator, as nanoGPT's get_batch draws the next "
            "batch), a value carried across end_step() in a local variable, or one rank's buffers (BatchNorm statistics); number "
            "batches by step (docs/your-code.md)"
        )
    if first_step is not None and after:
        lead = f"{first_step - after[-1]} steps after the resume from step {after[-1]}: "
    else:
        lead = ""
    return lead + "; ".join(HINTS[kind] for kind in dict.fromkeys(kinds)) if kinds else lead + "the losses differ"


def final_state(run_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """The newest committed checkpoint of a run dir: every leaf of its shared file and of every
    rank's own file (`rank N:` before the latter's), and the buffers' names."""
    from trainers.checkpoint.checkpointer import load_piece, verify
    from trainers.checkpoint.layout import SHARED, rank_file
    from trainers.checkpoint.storage import stored_checkpoints

    store = stored_checkpoints(run_dir / "checkpoints")
    steps = store.committed_steps()
    if not steps:
        raise FileNotFoundError(f"{run_dir}: no committed checkpoint")
    newest = verify(store, steps[-1])
    flat = {f"shared:{k}": v for k, v in flatten(load_piece(store, newest, SHARED)).items()}
    buffers: set[str] = set()
    for rank in range(newest.world_size):
        own = flatten(load_piece(store, newest, rank_file(rank)))
        flat.update({f"rank {rank}:{k}": v for k, v in own.items()})
        buffers |= {k.split(".", 1)[1] for k in own if k.startswith("buffers.")}
    return flat, sorted(buffers)
