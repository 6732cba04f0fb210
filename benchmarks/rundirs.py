"""What a run leaves in its run directory, read by the tests and by the benchmarks alike: the run
dirs under a root, the step log, the newest checkpoint's model, the rank processes of a run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

from collectives.mpirun import local_ranks_environment
from trainers.checkpoint.checkpointer import Committed, load_piece, verify
from trainers.checkpoint.layout import SHARED, rank_file
from trainers.checkpoint.storage import CheckpointStore, stored_checkpoints

ROOT = Path(__file__).resolve().parents[1]

# Launchers whose command line also names the rank entry point: never a rank themselves.
LAUNCHERS = {"mpirun", "mpiexec", "orterun", "prterun", "srun"}


def run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in (root / "runs").glob("*/*/config.yaml"))


def newest_checkpoint(run_dir: Path) -> tuple[CheckpointStore, Committed]:
    """The run's newest committed checkpoint, wherever it keeps them (checkpoint.uri: an object store)."""
    store = stored_checkpoints(run_dir / "checkpoints")
    return store, verify(store, store.committed_steps()[-1])


def newest_shared_state(run_dir: Path) -> dict[str, Any]:
    """The shared state of the run's newest checkpoint, with each registered object's state (model,
    optimizer, schedule, scaler, progress) under its name too."""
    store, newest = newest_checkpoint(run_dir)
    shared = load_piece(store, newest, SHARED)
    return {**shared, **shared.get("state", {})}


def state_hash(run_dir: Path) -> str:
    """A digest of the newest checkpoint's model weights (consolidated where the ranks saved rows)."""
    from trainers.checkpoint.export import checkpoint_weights

    store, newest = newest_checkpoint(run_dir)
    state = load_piece(store, newest, SHARED)
    ranks = lambda: (load_piece(store, newest, rank_file(rank)) for rank in range(newest.world_size))  # noqa: E731
    model = checkpoint_weights(ranks, state, "model")[1]  # the built-in loop's, or a run handle's "model"
    digest = hashlib.sha256()
    for name, tensor in sorted(model.items()):
        digest.update(name.encode() + tensor.numpy().tobytes())
    return digest.hexdigest()


def step_losses(run_dir: Path) -> dict[int, float]:
    """Last logged loss per step (steps re-run after a restart log again)."""
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "steps.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def rank_pids(run_dir: Path, entry: str = "hpc.rank.main") -> list[int]:
    """The rank processes of a run: Python interpreters running module `entry` with the run dir
    (under srun and mpirun alike); never a launcher whose command line names
    it too (mpirun, srun, hpc.launching.ranks), nor a rank's loader process (data.workers: forked
    from the rank, it has the rank's command line and the rank for its parent). Where a local
    run's warm process lives (`-m hpc.rank.warm RUN_DIR`, hpc.launching.ranks), its forks: they are
    the ranks, and mpirun's processes only pass signals on to them."""
    warm = _processes(run_dir, "hpc.rank.warm")
    servers = [pid for pid, parent in warm.items() if parent not in warm]
    if servers:
        return [pid for pid, parent in warm.items() if parent in servers]
    ranks = _processes(run_dir, entry)
    return [pid for pid, parent in ranks.items() if parent not in ranks]


def _processes(run_dir: Path, module: str) -> dict[int, int]:
    """pid -> parent pid of each Python process running `module` on the run dir (no launcher)."""
    out = subprocess.run(["pgrep", "-f", re.escape(f"{module} {run_dir}")], capture_output=True, text=True)  # pgrep takes a regex
    parents = {}
    for pid in map(int, out.stdout.split()):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        found = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None
        if name not in LAUNCHERS and found == module:
            parents[pid] = parent
    return parents


def ranks_environment() -> dict[str, str]:
    """What ranks started by hand (tests, benchmarks) run with: as a job's ranks, importing this checkout."""
    return {**local_ranks_environment(os.environ), "PYTHONPATH": str(ROOT)}


def resume_command(run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """A local run's command.txt, and the environment to run it in again."""
    return shlex.split((run_dir / "command.txt").read_text()), ranks_environment()
