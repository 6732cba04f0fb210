"""The run handle's core: the guarantees of the built-in loop for a loop the user owns.

What a script registers (models, optimizers, schedulers, the grad scaler, a data position, any
object with state_dict/load_state_dict, plain values) is restored from the newest committed
checkpoint at start; at every step boundary one small allreduce carries the stop vote, the save
handshake, the timed-save vote and the step's metrics, so every rank decides alike whether to
save and whether to stop; saves use the checkpoint protocol of trainers.checkpoint.checkpointer. Shared state
(replicated by data parallelism) is written once, by rank 0; state marked `per_rank` and the RNG
streams by every rank. hpc.run builds this from the launcher's environment.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from collectives.base import Collectives
from collectives.fsdp import join_sharded, sharded_keys, split_sharded, templates_of
from collectives.zero import ShardingError, is_sharded
from trainers.boundary import PendingVote, StepBoundary, StepVote
from trainers.checkpoint.checkpointer import CheckpointError
from trainers.checkpoint.recovery import newest_agreed
from trainers.checkpoint.saving import SaveCoordinator
from trainers.checkpoint.shards import restore_optimizer
from trainers.checkpoint.state import check_compatible, rank_buffers, restore_rank_buffers, restore_rng, rng_state
from trainers.preemption import StopFlag
from trainers.reporting import metricnames
from trainers.reporting.memory import peaks_over_ranks
from trainers.reporting.metrics import MetricsWriter
from trainers.reporting.reporter import StepReporter
from trainers.task import TaskError

log = logging.getLogger("trainers")

HANDLE_FORMAT = 1  # the layout of a handle's checkpoint (shared["handle"]["format"])
SCRIPT_TASK = "script"  # model_config["task"] of a handle's checkpoint: the built-in loop refuses it
PLAIN_TYPES = (bool, int, float, str, type(None))


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
                    said.append(f"keeps {kind} {', '.join(map(repr, missing))} that this script does not register")
                if extra:
                    said.append(f"lacks {kind} {', '.join(map(repr, extra))} that this script registers")
                return " and ".join(said)
        return None

    def load(self, step: int, shared: dict[str, Any], own: dict[str, Any] | None, ranks: Callable[[], Iterable[dict[str, Any]]]) -> None:
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
            if keys:  # FSDP2's DTensors: this rank's rows now, from its own file or every rank's
                saved = joined_dtensors(obj, name, saved, keys, own, ranks, step)
            load_into(obj, saved, name, step)
        self.values.update(shared["values"])
        if own is None:  # the world size changed: every rank starts from rank 0's buffers
            return
        for name, obj in self.shared.items():
            if isinstance(obj, nn.Module):
                restore_rank_buffers(obj, own.get("buffers", {}).get(name), step)
        for name, obj in self.own.items():
            load_into(obj, own["state"][name], name, step)


def shards_of(name: str, ranks: Callable[[], Iterable[dict[str, Any]]]) -> Callable[[], Iterable[dict[str, Any]]]:
    """Every rank's saved shard of sharded optimizer `name`, read one file at a time."""
    return lambda: (own["optimizer_shards"][name] for own in ranks())


def joined_dtensors(
    obj: Any, name: str, saved: Any, keys: list[str], own: dict[str, Any] | None, ranks: Callable[[], Iterable[dict[str, Any]]], step: int
) -> Any:
    """A saved state dict with its DTensors rebuilt as the live object lays them out now."""
    try:
        templates = templates_of(obj, name, keys)
        mine = (own or {}).get("dtensor_pieces")
        if mine is not None:
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


# Counts a script may pass to end_step() (this rank's samples or tokens in the step): steps.jsonl
# then holds their rate over all ranks, under the built-in loop's names.
COUNTED = {"samples": "samples_per_s", "tokens": "tokens_per_s"}


@dataclass
class Handle:
    """One per rank; see hpc.run for the user's side."""

    comm: Collectives
    registry: Registry
    boundary: StepBoundary  # the stop vote, the save handshake, saving: as in the built-in loop
    reporter: StepReporter = field(default_factory=lambda: StepReporter(None))
    metrics: MetricsWriter = field(default_factory=lambda: MetricsWriter(None))
    config_text: str = ""
    step: int = 0
    resumed_from: int | None = None
    stopped_by: str | None = None
    finished: bool = False
    owned_comm: bool = False  # the handle started the collectives it votes through (MPI): it closes them
    last: dict[str, float] = field(default_factory=dict)  # the newest step's metrics (means over ranks)
    logged: dict[str, float] = field(default_factory=dict)  # the newest value of each metric log() wrote
    validation: dict[str, float] = field(default_factory=dict)  # the newest val_* passed to end_step()
    _step_began: float = field(default_factory=time.perf_counter)
    _pending: PendingVote | None = None

    @property
    def stop(self) -> StopFlag:
        return self.boundary.stop

    @property
    def coordinator(self) -> SaveCoordinator | None:
        return self.boundary.coordinator

    def agree_on_registry(self) -> None:
        """Every rank registered the same names (a mismatch would pair the wrong files on resume)."""
        everyone = metricnames.exchange(self.comm, self.registry.names())
        first = everyone[0] or ()
        for rank, other in enumerate(everyone):
            extra = [n for n in other or () if n not in first]
            missing = [n for n in first if n not in (other or ())]
            if extra or missing:
                who, whom, what = (rank, 0, extra[0]) if extra else (0, rank, missing[0])
                kind, name = what.split(":", 1)
                raise TaskError(
                    f"the ranks register different run state: rank {who} registers {kind} {name!r}, which rank {whom} does not; "
                    "every rank must register the same"
                )

    def restore(self, checkpoint_dir: Path, resume: bool = True) -> int | None:
        """Load the newest committed checkpoint into the registered state; its step, or None."""
        restored = newest_agreed(self.coordinator, self.comm, resume)
        if restored is None:
            log.info("starting fresh: no committed checkpoint in %s", checkpoint_dir)
            return None
        step, shared, own = restored
        handle = shared.get("handle")
        if not isinstance(handle, dict):
            task = shared.get("model_config", {}).get("task", "the built-in loop")
            raise CheckpointError(f"checkpoint step {step} in {checkpoint_dir} was written by task {task}, not by a script's run handle; use a new run dir")
        differs = self.registry.differences(handle)
        if differs:
            raise CheckpointError(f"checkpoint step {step} {differs}; register the same state or use a new run dir")
        checkpointer = self.coordinator.checkpointer if self.coordinator is not None else None
        self.registry.load(step, shared, own, lambda: checkpointer.rank_states(step) if checkpointer is not None else iter(()))
        if own is not None:
            restore_rng(own["rng"])
        elif self.registry.own:
            log.warning(
                "world size changed (%d ranks saved, %d now): per-rank state %s starts afresh, RNG streams too",
                handle.get("world_size", -1),
                self.comm.world_size,
                ", ".join(sorted(self.registry.own)),
            )
        self.step = self.resumed_from = step
        log.info("resumed from checkpoint step %d%s", step, "" if own is not None else " (world size changed: fresh RNG streams)")
        return step

    def end_step(self, metrics: dict[str, Any]) -> bool:
        """Count a step; share its metrics, the votes and the save handshake in one allreduce;
        save when due; True when every rank must stop now (the state is saved)."""
        if self.finished or self.stopped_by:
            raise TaskError("end_step() after the run was stopped or finished; leave the loop when end_step() returns True")
        names = tuple(sorted(metrics))
        for name in names:
            value = metrics[name]
            if isinstance(value, torch.Tensor) and value.numel() != 1 or not isinstance(value, torch.Tensor | int | float):
                raise TaskError(f"metric {name!r} is {describe(value)}; end_step() takes numbers or one-element tensors")
        self.step += 1
        now = time.perf_counter()
        step_s, self._step_began = now - self._step_began, now
        boundary = self.boundary
        boundary.stepped(self.step, self.resumed_from)
        earlier = self.settle()  # the previous step's vote, read now: its allreduce ran beside this step
        self._pending = boundary.launch(self.step, names, [metrics[n] for n in names], step_s)
        stop = earlier is not None and earlier.stop_votes > 0
        due = boundary.save_due(self.step, earlier)
        if stop or due:  # a save's own collectives come after this step's vote, on every rank alike
            latest = self.settle()
            stop = stop or (latest is not None and latest.stop_votes > 0)
        if stop:
            self.stopped_by = self.boundary.stop_name()
            self.save(synchronous=True)
            return True
        if due:
            self.save(synchronous=False)
        return False

    def settle(self) -> StepVote | None:
        """Read the vote in flight (None: none): its metrics reported, the save handshake advanced."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        vote = self.boundary.settle(pending)
        self.last = {name: value / self.comm.world_size for name, value in zip(pending.names, vote.values, strict=True)}
        self.validation.update({name: value for name, value in self.last.items() if name.startswith("val_")})
        record = {"step": pending.step, **self.last, "step_ms": 1000 * pending.step_s}
        for count, rate in COUNTED.items():  # a count each rank reports: the sum over ranks per second
            if count in self.last and pending.step_s > 0:
                record[rate] = self.last[count] * self.comm.world_size / pending.step_s
        self.reporter.report(record)
        return vote

    def log(self, metrics: dict[str, Any], step: int | None) -> None:
        """A record in metrics.jsonl (rank 0's values; no communication)."""
        record: dict[str, Any] = {"step": self.step if step is None else step}
        for name, value in metrics.items():
            number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if not isinstance(number, int | float) or isinstance(number, bool):
                raise TaskError(f"metric {name!r} is {describe(value)}; log() takes numbers or one-element tensors")
            record[name] = float(number)
        self.logged.update({k: v for k, v in record.items() if k != "step"})
        self.metrics.write(record)
        self.reporter.figures({name: value for name, value in record.items() if name != "step" and math.isfinite(value)}, int(record["step"]))

    def save(self, synchronous: bool = True) -> None:
        """A checkpoint of the current step (all ranks call it at the same point)."""
        if self.coordinator is None:
            return
        self.settle()  # the vote in flight first: collectives in the same order on every rank
        self.boundary.save(
            self.step,
            self.shared_state,
            lambda: {
                "rng": rng_state(),
                "state": self.registry.own_state(),
                "buffers": self.registry.rank_buffers(),
                "optimizer_shards": self.registry.optimizer_shards(),
                "dtensor_pieces": self.registry.dtensor_pieces(),
            },
            synchronous,
        )

    def shared_state(self) -> dict[str, Any]:
        return {
            "handle": {"format": HANDLE_FORMAT, "step": self.step, "world_size": self.comm.world_size, **self.registry.layout()},
            **self.registry.shared_state(),
            "config": self.config_text,
            "model_config": {"task": SCRIPT_TASK},
        }

    def finish(self) -> None:
        """The final save (when steps were trained since the last one), and everything closed."""
        if self.finished:
            return
        self.finished = True
        watchdog = self.boundary.watchdog
        if watchdog is not None:  # the other ranks may still be stepping: a stall names this rank
            watchdog.leave("left the loop (the run handle's finish())")
        ended_as = "FAILED"  # for the trackers; an exception leaves it so
        try:
            self.settle()  # the last step's vote: its metrics reported (a stop it carries comes too late to matter)
            if self.stopped_by is None and self.step > (self.resumed_from or 0):
                self.save(synchronous=True)
            elif self.coordinator is not None:
                self.coordinator.finish_pending()
            self.metrics.write({"step": self.step, "peak_memory_mib": peaks_over_ranks(self.comm)})
            ended_as = "STOPPED" if self.stopped_by is not None else "FINISHED"
        finally:
            self.close(ended_as)

    def close(self, ended_as: str = "FAILED") -> None:
        """`ended_as`: how this start ends for the metrics sinks (FINISHED, STOPPED, FAILED)."""
        boundary = self.boundary
        boundary.close()
        quiesce = getattr(self.comm, "quiesce", None)  # torch.distributed's threads let go of the votes (collectives/torchdist.py)
        if quiesce is not None:
            quiesce()
        if boundary.watchdog is not None:  # the handle's own (hpc.run started it)
            boundary.watchdog.close()
            boundary.watchdog = None
        self.reporter.close(ended_as)
        self.metrics.close()


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
