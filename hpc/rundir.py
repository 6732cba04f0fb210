"""The run directory: one folder per job holding everything about it.

    <run_dir>/config.yaml      resolved config the ranks read (data.path made absolute)
    <run_dir>/job.sbatch       the sbatch script as submitted (slurm)
    <run_dir>/job.json         job id, cluster, submission time
    <run_dir>/logs/rank-00000.log   one log per rank, every line carrying the rank
    <run_dir>/metrics.jsonl    per-epoch metrics averaged over ranks (rank 0 writes)
    <run_dir>/steps.jsonl      per-step loss averaged over ranks (rank 0 writes)
    <run_dir>/checkpoints/     committed checkpoints step-000000123/ (see trainers.checkpoint)
    <run_dir>/result.json      final metrics, written by rank 0 when training ends
    <run_dir>/slurm/           submitit's folder: pickled call, per-task stdout/stderr
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The code ranks run: put first on their PYTHONPATH so a job never needs an installed copy.
PROJECT_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def sbatch(self) -> Path:
        return self.path / "job.sbatch"

    @property
    def job(self) -> Path:
        return self.path / "job.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def steps(self) -> Path:
        return self.path / "steps.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def result(self) -> Path:
        return self.path / "result.json"

    @property
    def submitit(self) -> Path:
        return self.path / "slurm"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank:05d}.log"

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)

    def read_json(self, path: Path) -> dict[str, Any]:
        return json.loads(path.read_text())
