"""Metrics reported by rank 0 after averaging over ranks: a JSON-lines file in the run dir."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends one JSON object per line; a requeued job keeps appending to the same file."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self._path is None:  # ranks other than 0 report nothing
            return
        line = json.dumps({"time": round(time.time(), 3), **record}, sort_keys=True)
        with self._path.open("a") as f:
            f.write(line + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
