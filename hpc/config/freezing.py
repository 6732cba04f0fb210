"""What of a directory is frozen with a job (hpc.submit.snapshot): the files the code can import
or read as code, never the toolkit's own output nor the usual heavy folders.

A script run from its own folder with the default `run_root=runs` must not freeze that folder's
earlier runs (each holding a frozen copy of the toolkit): they would be copied again at every
launch. So, of a frozen directory (a script file's, a task's package, the toolkit's packages),
the `.py` and `.yaml` files are copied, except below a directory that is

- anywhere: the run root (`run_root`) or the copy being written; a run or sweep directory (it
  holds hpc.rundir.RUN_MARKER, which every run dir gets, wherever `run_root` or `hydra.run.dir`
  put it); a virtual environment (it holds `pyvenv.cfg` or `conda-meta/`); a hidden directory
  (`.git`, `.venv`, `.hydra`, `.tox`: no import reaches a name that starts with a dot);
  `__pycache__`;
- at the top of the frozen directory: a data or output folder (HEAVY_DIRS: `data`, `outputs`,
  `checkpoints`, `runs`, `wandb`, ...) that is not a Python package (holds no `__init__.py`).
  Deeper down those names stay: `conf/data/*.yaml` is a Hydra config group.

left_out() is that rule, pure; frozen_files() walks a directory with it.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from pathlib import Path

from hpc.rundir import RUN_MARKER

SOURCE_SUFFIXES = {".py", ".yaml"}  # what is frozen of a job's code
# Where data and the outputs of a run usually go, next to a script (Hydra's outputs/ and multirun/,
# W&B's, MLflow's and Lightning's logs, the toolkit's default run_root): at the top only.
HEAVY_DIRS = frozenset({"data", "datasets", "outputs", "multirun", "checkpoints", "runs", "wandb", "mlruns", "lightning_logs"})
ENVIRONMENT_MARKS = ("pyvenv.cfg", "conda-meta")  # a virtualenv's (venv, virtualenv, uv), a conda environment's


def left_out(directory: Path, root: Path, names: Collection[str], skip: Collection[Path] = ()) -> str | None:
    """Why `directory` (below `root`, the directory being frozen; `names`: its entries) is left
    out with all below it, or None when it is walked. `skip`: the run root and the copy being
    written, as `directory` is spelled (resolved alike). The root itself is never left out."""
    if directory == root:
        return None
    if directory in skip:
        return "the run root"
    if RUN_MARKER in names:
        return "a run directory"
    if directory.name.startswith("."):
        return "a hidden directory"
    if any(mark in names for mark in ENVIRONMENT_MARKS):
        return "a virtual environment"
    if directory.name == "__pycache__":
        return "bytecode"
    if directory.parent == root and directory.name in HEAVY_DIRS and "__init__.py" not in names:
        return "data or output, not a package"
    return None


def frozen_files(directory: Path, skip: Collection[Path] = ()) -> Iterator[Path]:
    """The files under `directory` frozen with a job, in name order (left_out's rule). `skip`:
    directories left out wherever they are (the run root, the copy being written)."""
    root = directory.resolve()
    skipped = {path.resolve() for path in skip}
    found = []
    for top, dirs, files in os.walk(root):
        here = Path(top)
        if left_out(here, root, [*dirs, *files], skipped) is not None:
            dirs.clear()  # nothing below it is walked either
            continue
        found += [here / name for name in files if Path(name).suffix in SOURCE_SUFFIXES and (here / name).is_file()]
    for path in sorted(found):
        yield directory / path.relative_to(root)
