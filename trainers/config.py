"""Typed configs owned by the trainer. Plain dataclasses: no hydra, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

MODELS = ("mlp", "cnn")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "constant")


@dataclass
class ModelConfig:
    name: str = "mlp"  # mlp | cnn
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 128])
    channels: list[int] = field(default_factory=list)  # conv channels (cnn only)
    dropout: float = 0.0


@dataclass
class DataConfig:
    # None: the built-in handwritten-digits set, converted once to HDF5 in the cache dir.
    path: str | None = None
    batch_size: int = 32  # per rank
    eval_batch_size: int = 512
    # Datasets the HDF5 file must hold (N x ... inputs, N integer labels).
    train_x: str = "train/x"
    train_y: str = "train/y"
    test_x: str = "test/x"
    test_y: str = "test/y"


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | adamw
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False
    schedule: str = "cosine"  # cosine decay to 0 over the run, or constant


@dataclass
class TrainerConfig:
    epochs: int = 20
    seed: int = 0
    max_steps: int | None = None  # stop early after this many optimizer steps
    accumulation_steps: int = 1  # micro-batches per optimizer step; no communication between
    threads_per_rank: int = 1  # torch intra-op threads; ranks share the node's cores


@dataclass
class CheckpointConfig:
    enabled: bool = True
    keep: int = 2  # committed checkpoints kept; fewer than 2 is refused
    every_steps: int = 0  # 0: not by step count
    every_minutes: float | None = 10.0  # None: not by time
    async_save: bool = True  # write on a background thread while training continues
    resume: bool = True  # start from the newest committed checkpoint in the run dir
