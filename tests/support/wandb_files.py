"""Reading back W&B's offline run files (`wandb/offline-run-*-ID/run-ID.wandb`) through the
toolkit's own reader (trainers/reporting/wandb_logs.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainers.reporting.wandb_logs import records

__all__ = ["history", "records", "run_records"]


def history(wandb_dir: Path, run_id: str, start: str = "offline-run-*-") -> list[dict[str, Any]]:
    """Every history row logged under `run_id`, over all its offline run dirs (or the one named
    `start`), in the order written."""
    rows = []
    for path in sorted(wandb_dir.glob(f"{start}*/run-{run_id}.wandb")):
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def run_records(wandb_dir: Path, run_id: str) -> list[Any]:
    """The run records (id, name, group, ...) of `run_id`'s offline run dirs, one per start."""
    found = []
    for path in sorted(wandb_dir.glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb")):
        found += [record.run for record in records(path) if record.WhichOneof("record_type") == "run"]
    return found
