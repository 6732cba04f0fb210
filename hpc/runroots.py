"""The run roots used on this machine, remembered so that `python -m hpc.status` with no dir
named finds runs wherever `run_root=` (or a hand-started run handle's run dir) put them.

One absolute path per line in `$XDG_STATE_HOME/hpc-toolkit/run-roots` (default
~/.local/state), newest last, at most MAX_ROOTS. Best effort: a home that cannot be written
remembers nothing, and nothing fails for it. Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_ROOTS = 50


def roots_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "hpc-toolkit" / "run-roots"


def remembered() -> list[Path]:
    """The run roots remembered, newest first, those that exist now."""
    try:
        lines = roots_file().read_text().splitlines()
    except OSError:
        return []
    return [Path(line) for line in reversed(lines) if line and Path(line).is_dir()]


def remember(root: Path) -> None:
    """`root` (made absolute) as the newest run root used."""
    path = str(root.absolute())
    if "\n" in path:
        return  # one per line
    try:
        known = [line for line in roots_file().read_text().splitlines() if line and line != path]
    except OSError:
        known = []
    try:
        roots_file().parent.mkdir(parents=True, exist_ok=True)
        tmp = roots_file().with_name(f"run-roots.{os.getpid()}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in [*known, path][-MAX_ROOTS:]))
        os.replace(tmp, roots_file())
    except OSError:
        pass
