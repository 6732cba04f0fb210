"""What of a directory is frozen with a job (hpc.launching.snapshot): the files the code can import
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

Every other file of the walked folders, and each data or output folder at the top, appears in
the copy as a link to the original (a script's and a user package's folders, not the
toolkit's): what a script reads beside its code, it reads live, as under torchrun.

left_out() is that rule, pure; walked() walks a directory with it.
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
DATA_OR_OUTPUT = "data or output, not a package"
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
        return DATA_OR_OUTPUT
    return None


def frozen_files(directory: Path, skip: Collection[Path] = ()) -> Iterator[Path]:
    """The files under `directory` frozen with a job, in name order (left_out's rule). `skip`:
    directories left out wherever they are (the run root, the copy being written)."""
    sources, _ = walked(directory, skip)
    yield from sources


def walked(directory: Path, skip: Collection[Path] = ()) -> tuple[list[Path], list[Path]]:
    """(the source files under `directory`, frozen; what else a script may read beside its code,
    linked into the copy: the other files of the walked folders, and the data and output
    folders at the top), each in name order and spelled below `directory`. Links keep
    `Path(__file__).parent / "vocab.json"` and a `data/` beside the script reading the live
    files, as under torchrun; run dirs, environments and hidden folders are neither."""
    root = directory.resolve()
    skipped = {path.resolve() for path in skip}
    sources: list[Path] = []
    others: list[Path] = []
    for top, dirs, files in os.walk(root):
        here = Path(top)
        why = left_out(here, root, [*dirs, *files], skipped)
        if why is not None:
            dirs.clear()  # nothing below it is walked either
            if why == DATA_OR_OUTPUT and here.name != "runs":  # the toolkit's default run root: run dirs, each with a copy
                others.append(here)
            continue
        for name in files:
            if (here / name).is_file():
                (sources if Path(name).suffix in SOURCE_SUFFIXES else others).append(here / name)
    return [directory / path.relative_to(root) for path in sorted(sources)], [directory / path.relative_to(root) for path in sorted(others)]
