"""Typed config owned by collectives/. Plain dataclass: no hydra, no torch."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("mpi",)


@dataclass
class CommConfig:
    backend: str = "mpi"
