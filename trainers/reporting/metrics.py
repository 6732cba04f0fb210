"""Metrics reported by rank 0 after averaging over ranks: a JSON-lines file in the run dir."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

from trainers.faults import FAULTS


class MetricsWriter:
    """Appends one JSON object per line; a requeued job keeps appending to the same file. The file
    stays open (opening it for every step's line cost a step more than the rest of its report);
    each line reaches the file as it is written (line buffering), for readers like hpc.status.
    A write the file system refuses (full, read-only: trainers.faults) is noted, not raised: the
    ranks end together at the next step boundary, and this writer writes nothing more."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._file: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self._path is None:  # ranks other than 0 report nothing
            return
        line = json.dumps({"time": round(time.time(), 3), **record}, sort_keys=True)
        try:
            if self._file is None:
                self._file = self._path.open("a", buffering=1)
            self._file.write(line + "\n")
        except OSError as err:
            self.refused(err)

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as err:
                self.refused(err)

    def refused(self, err: OSError) -> None:
        """The file system said no: noted for the step vote (any other error is raised); the file
        closed as far as it can be, and nothing written after (a half line stays the last)."""
        path, self._path = self._path, None
        if not FAULTS.note(err, path):
            raise err
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass  # its buffer cannot reach the disk either


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
