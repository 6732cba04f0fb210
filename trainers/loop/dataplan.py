"""The data plan: the task's splits (checked alike on every rank), the sampler that shards the
training split over the ranks, and how a pass's batches are read ahead (worker processes kept
for the run, or a thread, or the training thread for a data set that draws random numbers)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from collectives.base import Collectives
from trainers import rngstreams
from trainers.checkpoint.state import Progress
from trainers.config import DataConfig
from trainers.data.loader import Pass, WorkerLoader
from trainers.data.reading import Prefetcher
from trainers.data.sampler import ShardSampler
from trainers.task import MapDataset, Task, TaskError, pin, read_items

log = logging.getLogger("trainers")


@dataclass
class DataPlan:
    """The splits, the sampler and the readers of one run."""

    train: MapDataset
    val: MapDataset
    held_out: MapDataset | None  # the task's test split: evaluated once, when training is complete
    sampler: ShardSampler
    accumulation: int  # micro-batches per step
    loader: WorkerLoader | None = None  # data.workers > 0: the processes reading batches
    read_on_training_thread_said: bool = False  # the one line saying so is logged

    @property
    def step_samples(self) -> int:
        """The samples of one step over every rank: the data position moves by this."""
        return self.accumulation * self.sampler.global_batch

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.sampler.steps_per_epoch // self.accumulation)

    def epoch_unfinished(self, progress: Progress) -> bool:
        """Another step's data is left in this epoch (max_steps stopped the pass)."""
        return progress.position + self.step_samples <= self.sampler.steps_per_epoch * self.sampler.global_batch

    def batches(self, task: Task, data: DataConfig, streams: tuple[int, int], device: torch.device, epochs: int, progress: Progress) -> Prefetcher | Pass:
        """The pass's batches read ahead from the data position: on worker processes
        (data.workers), started at the first pass and kept for the run, or on a thread. A task's
        own data set may draw random numbers (transforms): each batch is read in a stream of its
        own (trainers/rngstreams.py; `streams`: the run's seed and this rank), and with
        data.workers=0 on the training thread, whose stream a reading thread would share."""
        indices = self.sampler.batches(progress.epoch, start=progress.position)
        page_locked = pin if device.type == "cuda" else None
        if data.workers == 0:
            return self.read_here(indices, data, streams, progress.epoch, page_locked)
        if self.loader is None:
            collate = getattr(task, "collate_where_read", lambda: None)()  # a user task's items: collated in the worker
            self.loader = WorkerLoader(self.train, data.workers, data.batch_size, data.prefetch, streams=streams, collate=collate)
        epoch = progress.epoch
        following = (lambda: self.sampler.batches(epoch + 1)) if epoch < epochs else None  # read while this epoch ends
        return self.loader.epoch(indices, pin=page_locked, epoch=epoch, start=progress.position, following=following)

    def read_here(self, indices: Iterator[np.ndarray], data: DataConfig, streams: tuple[int, int], epoch: int, page_locked: Any) -> Prefetcher:
        """data.workers=0: read on a thread ahead of the step, or on the training thread for a
        data set that may draw random numbers."""
        if not getattr(self.train, "draws_random", True):
            return Prefetcher(lambda rows: read_items(self.train, rows), indices, depth=data.prefetch, pin=page_locked)
        if not self.read_on_training_thread_said:
            self.read_on_training_thread_said = True
            log.info(
                "data.workers=0: %s is read on the training thread, each batch in its own random stream (no read-ahead); "
                "data.workers>=1 reads ahead on processes, or give the class draws_random = False if reading draws no random numbers",
                type(self.train).__name__,
            )
        seed, rank = streams

        def read_in_own_stream(rows: np.ndarray) -> Any:
            with rngstreams.isolated(rngstreams.batch_seed(seed, rank, epoch, rows)):
                return read_items(self.train, rows)

        return Prefetcher(read_in_own_stream, indices, depth=0, pin=page_locked)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        for data in (self.train, self.val, self.held_out):
            close = getattr(data, "close", None)  # a data set holding a file
            if close is not None:
                close()


def build_data_plan(task: Task, comm: Collectives, batch_size: int, seed: int, accumulation: int) -> DataPlan:
    """The task's training, validation and (optional) test sets, checked alike on every rank, and
    the training split's sampler for this rank."""
    train, val, held_out = task.train_data(), task.eval_data(), task.test_data()
    check_data_sets(train, val, comm)
    if held_out is not None:
        check_data_sets(train, held_out, comm, "test")
    sampler = ShardSampler(len(train), batch_size, comm.rank, comm.world_size, seed)
    return DataPlan(train, val, held_out, sampler, accumulation)


def check_data_sets(train: MapDataset, evaluated: MapDataset, comm: Collectives, split: str = "validation") -> None:
    """Every rank must see the same data sets (lengths agree), and evaluation must give every
    rank at least one sample (the ranks learn the metric names from their first batch)."""
    lengths = torch.tensor([len(train), -len(train), len(evaluated), -len(evaluated)], dtype=torch.float64)
    comm.allreduce_(lengths, op="max")
    if lengths[0] != -lengths[1] or lengths[2] != -lengths[3]:
        raise TaskError(
            f"ranks see data sets of different lengths (train {int(-lengths[1])}..{int(lengths[0])}, "
            f"{split} {int(-lengths[3])}..{int(lengths[2])}); every rank must build the same data"
        )
    if len(evaluated) < comm.world_size:
        raise TaskError(f"the {split} data set has {len(evaluated)} samples, fewer than the {comm.world_size} ranks; give it at least one per rank")
