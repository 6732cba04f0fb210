"""Every loop's state and its one checkpoint layout: the built-in loop and a script's run handle
register what they keep (models, optimizers, schedules, the grad scaler, the data position, any
object with state_dict/load_state_dict, plain values, state kept per rank) in a Registry, save it
with `shared_checkpoint`/`own_checkpoint` and resume it with `restore_checkpoint`, the one
restore path (trainers.checkpoint.legacy reads the built-in loop's layout of before).

Shared state (replicated by data parallelism) is written once, by rank 0, in shared.ckpt; every
rank writes its RNG streams, its per-rank state, its own copy of every model buffer (BatchNorm
statistics differ between ranks), its ZeRO optimizer shard and its rows of every DTensor (FSDP2)
in its own file. A DTensor saved in rows loads into a DTensor of any world size or into a plain
tensor, and a plain tensor into a DTensor: a run may change comm.sharding between starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from collectives.fsdp import distributed_where_live, join_sharded, sharded_keys, split_sharded, templates_of
from collectives.zero import ShardingError, is_sharded
from trainers.checkpoint.checkpointer import CheckpointError
from trainers.checkpoint.legacy import LEGACY_FORMAT, from_loop_layout, own_from_loop_layout
from trainers.checkpoint.shards import restore_optimizer
from trainers.checkpoint.state import check_compatible, rank_buffers, restore_rank_buffers, restore_rng, rng_state
from trainers.task import TaskError

log = logging.getLogger("trainers")

SCRIPT_TASK = "script"  # model_config["task"] of a script's checkpoint (the run handle's)
REGISTRY_FORMAT = 2  # shared["registry"]["format"]; 1: the run handle's, under "handle", the same layout
PLAIN_TYPES = (bool, int, float, str, type(None))
RankFiles = Callable[[], Iterable[dict[str, Any]]]  # every rank's own file of a checkpoint, read one at a time


@dataclass(frozen=True)
class PerRank:
    """Registered state that differs between ranks (a data cursor, a stream's position): every
    rank saves and restores its own copy."""

    obj: Any


def per_rank(obj: Any) -> PerRank:
    return PerRank(obj)


def unwrapped(obj: Any) -> Any:
    """The module inside DistributedDataParallel and torch.compile wrappers: checkpoints keep
    plain parameter names, so a resume may add or drop either."""
    while isinstance(obj, nn.Module):
        inner = getattr(obj, "_orig_mod", None) or getattr(obj, "module", None)
        if not isinstance(inner, nn.Module) or type(obj).__name__ not in ("OptimizedModule", "DistributedDataParallel", "DataParallel"):
            return obj
        obj = inner
    return obj


def not_plain(obj: Any, where: str) -> str | None:
    """Where `obj` holds something a checkpoint cannot keep without pickling (None: nothing)."""
    if isinstance(obj, torch.Tensor) and type(obj).__name__ == "DTensor":
        return f"{where} is a DTensor (FSDP2's sharded tensor): register it as shared run state (start_run(name=obj)), not per_rank()"
    if isinstance(obj, torch.Tensor) or type(obj) in PLAIN_TYPES:
        return None
    if type(obj) is dict or type(obj).__name__ == "OrderedDict":
        for key, value in obj.items():
            if type(key) not in (str, int):
                return f"{where} has a key of type {type(key).__name__}"
            found = not_plain(value, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if type(obj) in (list, tuple) or isinstance(obj, torch.Size):
        return next((found for i, value in enumerate(obj) if (found := not_plain(value, f"{where}[{i}]"))), None)
    return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}"


def stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class Registry:
    """The named state a run keeps: objects with state_dict/load_state_dict (shared or per rank)
    and plain values (read and set through the handle)."""

    def __init__(self, entries: dict[str, Any]) -> None:
        self.shared: dict[str, Any] = {}
        self.own: dict[str, Any] = {}
        self.values: dict[str, Any] = {}
        for name, entry in entries.items():
            own = isinstance(entry, PerRank)
            obj = entry.obj if own else entry
            if stateful(obj):
                (self.own if own else self.shared)[name] = unwrapped(obj)
                continue
            problem = not_plain(obj, name)
            if own or problem:
                nested = f" ({problem})" if problem and not own and not problem.startswith(f"{name} is ") else ""  # deep inside a list or dict
                raise TaskError(
                    f"run state {name!r} is a {type(obj).__module__}.{type(obj).__qualname__}{nested}: register objects with "
                    "state_dict() and load_state_dict(), or plain values (numbers, strings, tensors, lists and dicts of them)"
                    + ("; per_rank() takes objects with state_dict() only" if own else "")
                )
            self.values[name] = obj

    def layout(self) -> dict[str, list[str]]:
        return {"state": sorted(self.shared), "values": sorted(self.values), "per_rank": sorted(self.own)}

    def names(self) -> tuple[str, ...]:
        """Every name with its kind, for comparing registries between ranks."""
        return tuple(f"{kind}:{name}" for kind, names in self.layout().items() for name in names)

    def shared_state(self) -> dict[str, Any]:
        sharded = sorted(name for name, obj in self.shared.items() if is_sharded(obj))
        return {"state": checked_states(self.shared, split=True), "values": dict(self.values), "sharded": sharded}

    def dtensor_pieces(self) -> dict[str, Any]:
        """This rank's rows of every DTensor in the shared state (a script's FSDP2 model and
        optimizer): saved in its own file, keyed by object and place."""
        return {"pieces": [piece for name, obj in self.shared.items() for piece in split_sharded(obj.state_dict(), name)[1]]}

    def own_state(self) -> dict[str, Any]:
        return checked_states(self.own)

    def rank_buffers(self) -> dict[str, Any]:
        """Every registered model's buffers as this rank holds them (BatchNorm statistics differ
        between ranks unless DDP broadcasts them or SyncBatchNorm shares them)."""
        return {name: rank_buffers(obj) for name, obj in self.shared.items() if isinstance(obj, nn.Module)}

    def optimizer_shards(self) -> dict[str, Any]:
        """The optimizer state each sharded optimizer keeps on this rank (comm.sharding)."""
        return {name: obj.shard_state() for name, obj in self.shared.items() if is_sharded(obj)}

    def differences(self, saved: dict[str, list[str]]) -> str | None:
        """How a checkpoint's registry differs from this one (None: alike)."""
        mine = self.layout()
        for kind, names in mine.items():
            theirs = list(saved.get(kind, []))
            missing, extra = [n for n in theirs if n not in names], [n for n in names if n not in theirs]
            if missing or extra:
                said = []
                if missing:
                    said.append(f"keeps {kind} {', '.join(map(repr, missing))} that this run does not register")
                if extra:
                    said.append(f"lacks {kind} {', '.join(map(repr, extra))} that this run registers")
                return " and ".join(said)
        return None

    def load(self, step: int, shared: dict[str, Any], own: dict[str, Any] | None, ranks: RankFiles) -> None:
        """The registered state from checkpoint `step`: `own` is this rank's file (None when the
        world size changed); `ranks` reads every rank's file (a sharded optimizer's state)."""
        sharded = set(shared.get("sharded", []))
        for name, obj in self.shared.items():
            saved = shared["state"][name]
            if name in sharded:
                mine = (own or {}).get("optimizer_shards", {}).get(name)
                restore_optimizer(obj, saved, True, mine, shards_of(name, ranks), step)
                continue
            keys = sharded_keys(saved)
            if keys:  # FSDP2's DTensors: this rank's rows now (or whole), from its own file or every rank's
                saved = joined_dtensors(obj, name, saved, keys, own, ranks, step)
            load_into(obj, in_rows_where_sharded(obj, name, saved, step), name, step)
        self.values.update(shared["values"])
        if own is None:  # the world size changed: every rank starts from rank 0's buffers
            return
        for name, obj in self.shared.items():
            if isinstance(obj, nn.Module):
                restore_rank_buffers(obj, own.get("buffers", {}).get(name), step)
        for name, obj in self.own.items():
            load_into(obj, own["state"][name], name, step)


def shards_of(name: str, ranks: RankFiles) -> RankFiles:
    """Every rank's saved shard of sharded optimizer `name`, read one file at a time."""
    return lambda: (own["optimizer_shards"][name] for own in ranks())


def joined_dtensors(obj: Any, name: str, saved: Any, keys: list[str], own: dict[str, Any] | None, ranks: RankFiles, step: int) -> Any:
    """A saved state dict with its DTensors rebuilt as the live object lays them out now."""
    try:
        templates = templates_of(obj, keys)
        mine = (own or {}).get("dtensor_pieces")
        if mine is not None and all(template is not None for template in templates.values()):
            try:
                return join_sharded(saved, templates, [mine])
            except ShardingError:
                pass  # sharded otherwise than when saved: every rank's rows
        return join_sharded(saved, templates, (rank.get("dtensor_pieces", {"pieces": []}) for rank in ranks()))
    except ShardingError as err:
        raise CheckpointError(f"checkpoint step {step} does not fit run state {name!r}: {err}") from None


def checked_states(objects: dict[str, Any], split: bool = False) -> dict[str, Any]:
    """Every object's state dict, refused in one line where it would need pickling; `split`:
    DTensors replaced by markers (their rows go into each rank's own file)."""
    states = {}
    for name, obj in objects.items():
        state = split_sharded(obj.state_dict(), name)[0] if split else obj.state_dict()
        problem = not_plain(state, f"{name}.state_dict()")
        if problem:
            raise TaskError(
                f"run state {name!r} cannot be saved without pickling: {problem}; keep tensors, numbers, strings, lists and dicts in its state_dict"
            )
        states[name] = state
    return states


def load_into(obj: Any, state: Any, name: str, step: int) -> None:
    if isinstance(obj, nn.Module):
        check_compatible(obj, state, step)
    try:
        obj.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError, TypeError) as err:
        reason = " ".join(str(err).split())[:200]
        raise CheckpointError(f"checkpoint step {step} does not fit run state {name!r}: {reason}; register the same objects or use a new run dir") from None


def in_rows_where_sharded(obj: Any, name: str, saved: Any, step: int) -> Any:
    """`saved` with every whole tensor that stands where the live object now holds a DTensor
    (a checkpoint of an unsharded run resumed with FSDP2) cut to this rank's rows of it."""
    try:
        return distributed_where_live(obj, saved)
    except ShardingError as err:
        raise CheckpointError(f"checkpoint step {step} does not fit run state {name!r}: {err}") from None


def shared_checkpoint(registry: Registry, step: int, world_size: int, config_text: str, model_config: dict[str, Any]) -> dict[str, Any]:
    """shared.ckpt (rank 0's): the registry's layout, its shared state and values, the run's config
    text and what trained it (`model_config["task"]`: a task's name, or SCRIPT_TASK)."""
    return {
        "registry": {"format": REGISTRY_FORMAT, "step": step, "world_size": world_size, **registry.layout()},
        **registry.shared_state(),
        "config": config_text,
        "model_config": model_config,
    }


def own_checkpoint(registry: Registry) -> dict[str, Any]:
    """This rank's own file: its RNG streams, per-rank state, buffers and shards."""
    return {
        "rng": rng_state(),
        "state": registry.own_state(),
        "buffers": registry.rank_buffers(),
        "optimizer_shards": registry.optimizer_shards(),
        "dtensor_pieces": registry.dtensor_pieces(),
    }


def trainer_of(task: str) -> str:
    return "a script's run handle" if task == SCRIPT_TASK else f"task {task}"


def saved_task(shared: dict[str, Any]) -> str:
    return str(shared.get("model_config", {}).get("task", "?"))


def upgraded(step: int, shared: dict[str, Any], own: dict[str, Any] | None, ranks: RankFiles) -> tuple[dict[str, Any], dict[str, Any] | None, RankFiles]:
    """A checkpoint in the registry layout: as saved, or read from an older layout."""
    if isinstance(shared.get("registry"), dict):
        return shared, own, ranks
    if isinstance(shared.get("handle"), dict):  # the run handle's format 1: this layout under its old name
        return {**shared, "registry": shared["handle"]}, own, ranks
    if "model" in shared and "progress" in shared:  # the built-in loop's own layout, before format 2
        own_file = None if own is None else own_from_loop_layout(own)
        return from_loop_layout(step, shared), own_file, lambda: (own_from_loop_layout(rank) for rank in ranks())
    raise CheckpointError(f"checkpoint step {step} has no layout this version reads (neither format {REGISTRY_FORMAT} nor {LEGACY_FORMAT}); use a new run dir")


def restore_checkpoint(registry: Registry, step: int, shared: dict[str, Any], own: dict[str, Any] | None, ranks: RankFiles, task: str) -> None:
    """The one restore path of every loop: checkpoint `step` (rank 0's `shared`, this rank's `own`
    file or None when the world size changed, every rank's files through `ranks`) into `registry`
    and this rank's RNG streams, refused in one line where it is another task's or registers other
    state."""
    shared, own, ranks = upgraded(step, shared, own, ranks)
    if saved_task(shared) != task:
        expected = "by a script" if task == SCRIPT_TASK else task
        raise CheckpointError(f"checkpoint step {step} was written by {trainer_of(saved_task(shared))}, not {expected}; use a new run dir or the old task")
    record = shared["registry"]
    differs = registry.differences(record)
    if differs:
        raise CheckpointError(f"checkpoint step {step} {differs}; register the same state or use a new run dir")
    registry.load(step, shared, own, ranks)
    if own is not None:
        restore_rng(own["rng"])
    elif registry.own:
        log.warning(
            "world size changed (%d ranks saved it): per-rank state %s starts afresh, RNG streams too",
            record.get("world_size", -1),
            ", ".join(sorted(registry.own)),
        )
