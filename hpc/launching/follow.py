"""Following a growing file (a job's console) line by line, for `wait` and the Python API."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


class Follower:
    """A file's new whole lines since the last look (a line still being written waits)."""

    def __init__(self, path: Path, emit: Callable[[str], None]) -> None:
        self.path, self.emit, self.offset, self.partial = path, emit, 0, ""

    def __call__(self, flush: bool = False) -> None:
        try:
            with self.path.open(errors="replace") as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except OSError:
            chunk = ""
        *lines, self.partial = (self.partial + chunk).split("\n")
        if flush and self.partial:
            lines, self.partial = [*lines, self.partial], ""
        for line in lines:
            if not line.startswith(SUBMITIT_LINE):
                self.emit(line)


SUBMITIT_LINE = "submitit "  # its job runner's own lines ("submitit INFO (...) - Starting with JobEnvironment(...)")
