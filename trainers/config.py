"""Typed configs owned by the trainer. Plain dataclasses: no hydra, no torch. Each section checks
its own settings (`check()`, raising ConfigError with the one line the login node shows);
checks that cross sections are hpc.config.validate's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MODELS = ("mlp", "cnn", "resnet50")
CLASSIFY_TASK = "trainers.tasks.classify.ClassifyTask"  # the default task (task=classify)
LM_TASK = "trainers.tasks.lm.LanguageModelTask"  # task=lm
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "constant")
PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A setting its own section refuses: the message is the one line the user sees."""


def at_least(settings: dict[str, float], low: float, why: str = "") -> None:
    """Each `key: value` at `low` or above, else the first one below, refused."""
    for key, value in settings.items():
        if value < low:
            raise ConfigError(f"{key}={value} must be >= {low}{why}")


def one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")


@dataclass
class ModelConfig:
    name: str = "mlp"  # mlp | cnn | resnet50 (torchvision)
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 128])
    channels: list[int] = field(default_factory=list)  # conv channels (cnn only)
    dropout: float = 0.0

    def check(self) -> None:
        """Layer widths and the dropout probability (the built-in task's models)."""
        for key, sizes in (("model.hidden_sizes", self.hidden_sizes), ("model.channels", self.channels)):
            if any(size < 1 for size in sizes):
                raise ConfigError(f"{key}={list(sizes)}: every width must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1): the probability of dropping a unit")


@dataclass
class DataConfig:
    # None: the built-in handwritten-digits set, converted once to HDF5 in the cache dir. Else
    # an HDF5 file, a directory of shards, a glob ("/data/in1k/train-*.h5") or a list of these
    # (python -m trainers.convert writes shards from numpy arrays or a folder of images).
    path: Any = None
    batch_size: int = 32  # per rank
    eval_batch_size: int = 512
    # Loader processes per rank (h5py holds a global lock: threads cannot read in parallel).
    # 0: one prefetch thread in the rank. Batches arrive in the sampler's order either way.
    workers: int = 0
    prefetch: int = 2  # batches read ahead of the step, per rank
    # Augmentation on the training device (task=classify), drawn from each rank's torch RNG,
    # which checkpoints keep: a random crop of this size after zero padding by crop_padding
    # (evaluation: the centre crop), and a random horizontal flip.
    crop: int | None = None
    crop_padding: int = 0
    flip: bool = False
    # Datasets the HDF5 files hold (N x ... inputs, N integer labels): the training split, the
    # validation split evaluated every epoch (files without one, written before it was named,
    # validate on their test split), and an optional held-out test split evaluated once, at the
    # end of a run that completed.
    train_x: str = "train/x"
    train_y: str = "train/y"
    val_x: str = "val/x"
    val_y: str = "val/y"
    test_x: str = "test/x"
    test_y: str = "test/y"

    def check(self) -> None:
        at_least({"data.batch_size": self.batch_size, "data.eval_batch_size": self.eval_batch_size}, 1)
        self.check_loading()

    def check_loading(self) -> None:
        """The readers and the crop (the step supervisor's preparation checks these alone)."""
        if self.workers < 0 or self.prefetch < 1:
            raise ConfigError(f"data.workers={self.workers} must be >= 0 (0: a thread in the rank) and data.prefetch={self.prefetch} >= 1")
        if (self.crop is not None and self.crop < 1) or self.crop_padding < 0:
            raise ConfigError(f"data.crop={self.crop} must be >= 1 (or null for none) and data.crop_padding={self.crop_padding} >= 0")
        if self.crop_padding and self.crop is None:
            raise ConfigError(f"data.crop_padding={self.crop_padding} pads for a random crop: set data.crop too (e.g. the image size)")


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | adamw
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False
    schedule: str = "cosine"  # cosine decay to min_lr over the run, or constant
    min_lr: float = 0.0  # the cosine's floor (scaled with lr under scale_lr)
    warmup_steps: int = 0  # linear warm-up from lr/100 (large global batches need it)
    betas: list[float] | None = None  # adamw's (beta1, beta2); null: (momentum, 0.999)
    # Linear scaling: lr is for reference_batch samples per step; the run uses
    # lr * global batch / reference_batch. Off: lr as given, whatever the global batch.
    scale_lr: bool = False
    reference_batch: int = 256
    # Hydra's `_target_` convention, e.g. {_target_: torch.optim.RMSprop, alpha: 0.9}: any
    # torch.optim.Optimizer, called with the parameter groups and lr (optim.lr, scaled as above,
    # unless given here). Set, it replaces name, momentum, weight_decay and nesterov.
    optimizer: dict[str, Any] = field(default_factory=dict)
    # {_target_: torch.optim.lr_scheduler.StepLR, step_size: 1000}: any LRScheduler, called with
    # the optimizer (and total_steps, when it takes it), stepped once per optimizer step. Set, it
    # replaces schedule and warmup_steps.
    scheduler: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """The optimizer and schedule named, the learning rate and its floor, AdamW's betas, the warm-up."""
        one_of("optim.name", self.name, OPTIMIZERS)
        one_of("optim.schedule", self.schedule, SCHEDULES)
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"optim.lr={self.lr} must be a finite number > 0")
        if not (math.isfinite(self.momentum) and self.momentum >= 0):
            raise ConfigError(f"optim.momentum={self.momentum} must be a finite number >= 0")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay} must be a finite number >= 0")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optim.min_lr={self.min_lr} must be between 0 and optim.lr={self.lr} (the cosine schedule's floor)")
        if self.betas is not None and (len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas)):
            raise ConfigError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1): AdamW's beta1 and beta2, e.g. [0.9,0.95]")
        if self.warmup_steps < 0 or self.reference_batch < 1:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0 and optim.reference_batch={self.reference_batch} >= 1")


@dataclass
class TrainerConfig:
    epochs: int = 20
    seed: int = 0
    max_steps: int | None = None  # stop early after this many optimizer steps
    accumulation_steps: int = 1  # micro-batches per optimizer step; no communication between
    # torch intra-op threads; None: the cores this rank owns (hpc.rank.binding.rank_threads)
    threads_per_rank: int | None = None
    # Samples per optimizer step over all ranks; set, it is kept whatever the rank count:
    # accumulation steps = global_batch / (ranks x data.batch_size), which must be whole.
    global_batch: int | None = None
    precision: str = "fp32"  # fp32 | bf16 (autocast) | fp16 (autocast + grad scaler)
    clip_grad_norm: float | None = None  # clip the averaged gradients to this global L2 norm
    channels_last: bool = False  # NHWC memory format for CNNs (faster convolutions on GPUs)
    # Keep only the inputs of the modules the task names (Task.checkpointed_modules) and recompute
    # their activations in backward: less memory for about a third more compute.
    activation_checkpointing: bool = False
    sync_batchnorm: bool = False  # BatchNorm statistics over all ranks' batches (comm=nccl: torch's is GPU-only)
    # GPU kernels that give the same bits on every run (torch.use_deterministic_algorithms, cuDNN
    # without autotuning, cuBLAS with a fixed workspace): slower, and what bit-exact resume on a GPU
    # needs, since atomics in some backward kernels change the last bits from run to run.
    deterministic: bool = False
    log_every: int = 10  # a progress line (and the Prometheus file) every this many steps
    straggler_every: int = 20  # compare the ranks' step times every this many steps (0: never)
    straggler_ratio: float = 1.5  # report the slowest rank when above this x the median
    prometheus_file: str | None = None  # rank 0 rewrites it (text format); relative: in the run dir
    tensorboard: bool = False  # event files in <run_dir>/tensorboard (needs the tensorboard package)
    # No finished step for this long: name the stalled rank, requeue (Slurm) and end the job
    # instead of hanging to the time limit. Must exceed evaluation and a synchronous checkpoint.
    watchdog_s: float | None = 600.0
    # Until the first step finishes (start-up: MPI/NCCL init, data, model, checkpoint loading)
    # the watchdog allows this long instead, if longer; a rank that never joins still ends the job.
    watchdog_startup_s: float = 1800.0
    # Steps with non-finite gradients are skipped (and counted); after this many in a row, roll
    # back to the last committed checkpoint and skip their data from then on. 0: never roll back.
    max_bad_steps: int = 3
    eval_every: int = 0  # also evaluate every this many steps, besides each epoch's end (0: epoch ends only)
    # torch.compile the model for the training step (evaluation runs it uncompiled). Checkpoints
    # keep plain parameter names either way, so a resume may switch it.
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend (inductor; aot_eager and eager compile faster, for checks)

    def check(self) -> None:
        """Counts, precision, clipping, evaluation, and the reporting and watching settings."""
        at_least({"trainer.epochs": self.epochs, **({"trainer.threads_per_rank": self.threads_per_rank} if self.threads_per_rank is not None else {})}, 1)
        at_least({"trainer.accumulation_steps": self.accumulation_steps}, 1)
        at_least({"trainer.seed": self.seed}, 0, " (torch's and numpy's generators take no negative seed)")
        if self.max_steps is not None:
            at_least({"trainer.max_steps": self.max_steps}, 1, ", or null for no limit")
        self.check_reporting()
        one_of("trainer.precision", self.precision, PRECISIONS)
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError(f"trainer.clip_grad_norm={self.clip_grad_norm} must be > 0, or null for off")
        at_least({"trainer.eval_every": self.eval_every}, 0, " (0: evaluate at epoch ends only)")

    def check_reporting(self) -> None:
        at_least({"trainer.log_every": self.log_every}, 1)
        at_least({"trainer.straggler_every": self.straggler_every}, 0, " (0: no straggler check)")
        if self.straggler_ratio <= 1:
            raise ConfigError(f"trainer.straggler_ratio={self.straggler_ratio} must be > 1 (the slowest rank vs the median)")
        if self.watchdog_s is not None and self.watchdog_s <= 0:
            raise ConfigError(f"trainer.watchdog_s={self.watchdog_s} must be > 0 seconds, or null for no watchdog")
        if self.watchdog_startup_s <= 0:
            raise ConfigError(f"trainer.watchdog_startup_s={self.watchdog_startup_s} must be > 0 seconds")
        at_least({"trainer.max_bad_steps": self.max_bad_steps}, 0, " (0: skip bad steps, never roll back)")


@dataclass
class CheckpointConfig:
    enabled: bool = True
    # Where checkpoints go instead of <run_dir>/checkpoints/: an fsspec URL (s3://bucket/prefix;
    # endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) or a directory. Each
    # run gets its own place under it (trainers.checkpoint.storage.run_location); null: the run dir.
    uri: str | None = None
    keep: int = 2  # committed checkpoints kept; fewer than 2 is refused
    every_steps: int = 0  # 0: not by step count
    every_minutes: float | None = 10.0  # None: not by time
    async_save: bool = True  # write on a background thread while training continues
    # Keep the newest checkpoint in the nodes' memory too, for a restart in the allocation (with
    # warm ranks: trainers.checkpoint.memory); false: a restart reads the store.
    in_memory: bool = True
    resume: bool = True  # start from the newest committed checkpoint in the run dir
    # Also keep the checkpoint of the best validation so far by this figure (val_loss, val_accuracy,
    # any val_ figure the task reports), saved when an evaluation improves it; best.json names it.
    best: str | None = None
    best_mode: str = "min"  # min | max: whether lower or higher of `best` is better
    # With `best`: the held-out test split is evaluated once, at the end, on the best checkpoint's
    # weights (model selection by validation, then one test); false: on the final weights.
    test_best: bool = True

    def check(self) -> None:
        """How often checkpoints are taken, that a fallback is kept, where they go, and which is kept as the best."""
        at_least({"checkpoint.every_steps": self.every_steps}, 0, " (0: off)")
        if self.every_minutes is not None and self.every_minutes <= 0:
            raise ConfigError(f"checkpoint.every_minutes={self.every_minutes} must be > 0, or null for off")
        if self.keep < 2:
            raise ConfigError(f"checkpoint.keep={self.keep}: keep at least 2 so a bad newest checkpoint has a fallback")
        if self.uri:
            from trainers.checkpoint.storage import is_object_url, unusable

            problem = unusable(self.uri) if is_object_url(self.uri) else None
            if problem:
                raise ConfigError(f"checkpoint.uri={problem}")
        if self.best_mode not in ("min", "max"):
            raise ConfigError(f"checkpoint.best_mode={self.best_mode!r} must be min or max")
        if self.best is None:
            return
        if not str(self.best).startswith("val_") or len(str(self.best)) == 4:
            raise ConfigError(f"checkpoint.best={self.best!r} must name a validation figure: val_loss, val_accuracy, or another val_ figure the task reports")
        if not self.enabled:
            raise ConfigError(f"checkpoint.best={self.best} keeps a checkpoint, but checkpoint.enabled=false; enable checkpoints or drop checkpoint.best")


def accumulation_steps(trainer: TrainerConfig, batch_size: int, world_size: int) -> int:
    """Micro-batches per optimizer step: from trainer.global_batch when set (kept constant
    whatever the rank count), else trainer.accumulation_steps. ValueError if not whole."""
    if trainer.global_batch is None:
        return trainer.accumulation_steps
    per_pass = batch_size * world_size
    if trainer.global_batch < per_pass or trainer.global_batch % per_pass:
        raise ValueError(
            f"trainer.global_batch={trainer.global_batch} is not a whole multiple of {world_size} ranks x "
            f"data.batch_size={batch_size} = {per_pass}; change data.batch_size or the rank count"
        )
    return trainer.global_batch // per_pass


def scaled_lr(optim: OptimConfig, global_batch: int) -> float:
    """optim.lr, or with optim.scale_lr the linear scaling rule: lr x global batch / reference."""
    return optim.lr * global_batch / optim.reference_batch if optim.scale_lr else optim.lr


def closure_refusal(target: str, argument: str) -> str:
    """The one line for an optimizer whose step() needs an argument (LBFGS's closure, SAM's):
    the login node and the rank give the same one."""
    return (
        f"optim.optimizer._target_={target}: its step() needs {argument!r} (a closure that evaluates the loss again, as LBFGS and SAM take); "
        "the toolkit steps once per batch on gradients averaged over ranks, with no closure: use a first-order optimizer (SGD, AdamW, ...)"
    )
