"""Freeze the code a job runs when it starts: at submission (Slurm), or at launch (local).

A job that waits in the queue, is requeued a day later, or a local run resumed next week from
its command.txt, must run the code it started with, not whatever the checkout holds by then.
We copy the packages' sources (a few hundred KB) into the run (or sweep) directory and put that
copy first on the ranks' PYTHONPATH (the sbatch script, hpc.slurm.batch; the mpirun command, hpc.launching.local);
SOURCE.json records the git commit and whether the tree was dirty, git.diff the changes. What of a
directory is copied (never the run root, a run dir, data, outputs, virtualenvs or .git) is
hpc.config.freezing's rule.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

from hpc.config.freezing import SOURCE_SUFFIXES, walked
from hpc.config.schema import JobConfig, code_targets
from hpc.config.scripts import SCRIPT_DIR, parse_script
from hpc.errors import UserError
from hpc.rundir import PROJECT_ROOT

PACKAGES = ("hpc", "trainers", "collectives")
MAX_LINKS = 10_000


def _git(args: list[str], root: Path) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def installed_roots() -> list[Path]:
    """Where the interpreter's standard library and installed packages live: the environment a
    job runs in, not code of the job's own (torch.optim is never copied into a run dir)."""
    names = ("stdlib", "platstdlib", "purelib", "platlib")
    paths = {sysconfig.get_path(name) for name in names} | {site.getusersitepackages()}  # pip install --user
    return [Path(path).resolve() for path in paths if path]


def user_sources(targets: Iterable[str], also_in: Sequence[str] = ()) -> list[Path]:
    """The top-level package directory (or module file) of every class the config names that is
    the user's own: outside the toolkit and outside the installed environment. Found where the
    ranks import from (and in `also_in`: a script module's working directory), without importing it."""
    search = [*(p for p in sys.path if p), *also_in]
    installed = installed_roots()
    found: dict[str, Path] = {}
    for target in targets:
        top = target.split(".")[0]
        if not top or top in PACKAGES or top in found or top in sys.builtin_module_names:
            continue  # the toolkit's own tasks are frozen with it
        spec = importlib.machinery.PathFinder.find_spec(top, search)
        if spec is None:
            raise UserError(f"_target_={target}: no module {top!r} on the import path to freeze with the job")
        locations = list(spec.submodule_search_locations or [])
        if locations:
            source = Path(locations[0])
        elif spec.origin and spec.origin.endswith(".py"):
            source = Path(spec.origin)
        else:
            raise UserError(f"_target_={target}: {top} is not Python source ({spec.origin}); it cannot be frozen with the job")
        if not any(source.resolve().is_relative_to(root) for root in installed):
            found[top] = source
    return list(found.values())


STORE = ".frozen"  # under the run root: the frozen files every run dir there links to (hard links)


def store_of(run_root: Path) -> Path:
    """The run root's store of frozen files for this process's umask (its run_access): a private
    run never links a file a group-readable run made, nor the other way round."""
    mask = os.umask(0)
    os.umask(mask)
    return run_root / STORE / f"umask-{mask:03o}"


def _place(source: Path, target: Path, store: Path | None) -> None:
    """`source`'s bytes at `target`: a hard link to the store's read-only file of the same bytes
    (made if new), so an unchanged file costs no space in each run dir; a copy where the store
    is not given or its file system takes no link."""
    if store is not None:
        data = source.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        kept = store / digest[:2] / digest
        try:
            if not kept.is_file():
                kept.parent.mkdir(parents=True, exist_ok=True)
                made = kept.with_name(f"{digest}.{os.getpid()}.tmp")
                made.write_bytes(data)
                made.chmod(made.stat().st_mode & ~0o222)  # read-only: every run dir linking it reads these bytes
                os.replace(made, kept)
            os.link(kept, target)
            return
        except OSError:
            pass
    shutil.copyfile(source, target)  # new mode from the umask (run_access), not the checkout's


def _copy_sources(source_root: Path, dest: Path, skip: Sequence[Path] = (), link_rest: bool = False, store: Path | None = None) -> int:
    """The sources under `source_root` (a directory or one file) copied to `dest` (through
    `store`: _place), but for those below `skip` (hpc.config.freezing); with `link_rest`, the
    rest linked (at most MAX_LINKS: a folder of a million images beside a script is read through
    its own path, or not at all). Returns the count copied."""
    if source_root.is_file():
        files, others = ([source_root] if source_root.suffix in SOURCE_SUFFIXES else []), list[Path]()
    else:
        files, others = walked(source_root, skip)
    for source in files:
        target = dest if source_root.is_file() else dest / source.relative_to(source_root)
        target.parent.mkdir(parents=True, exist_ok=True)
        _place(source, target, store)
    if link_rest and len(others) <= MAX_LINKS:
        for other in others:
            target = dest / other.relative_to(source_root)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(other.resolve())
    return len(files)


def freeze_job_code(dest: Path, *jobs: JobConfig) -> Path:
    """freeze_code for `jobs` (one, or a sweep's points sharing one copy): the toolkit, the user's
    packages their configs name (a task, an optimizer, a script's module) and a script file's
    directory."""
    targets = [target for job in jobs for target in code_targets(job)]
    script_dirs = set()
    for job in jobs:
        script = parse_script(job.script, Path(job.workdir or ".")) if job.script else None
        if script is not None and script.module is not None:
            targets.append(script.module)
        if script is not None and script.path is not None:
            script_dirs.add(script.path.parent)
    if len(script_dirs) > 1:
        listed = ", ".join(sorted(map(str, script_dirs)))
        raise UserError(f"the points of a sweep run scripts from {len(script_dirs)} directories ({listed}); sweep scripts of one directory")
    run_roots = sorted({Path(job.run_root) for job in jobs})  # relative: to where launch.py runs, as Hydra's run dir
    workdirs = sorted({str(Path(job.workdir or ".").absolute()) for job in jobs if job.script})  # `script=pkg.train`: found as `python -m` finds it
    script_dir = next(iter(script_dirs), None)
    return freeze_code(dest, user=user_sources(targets, workdirs), script_dir=script_dir, skip=run_roots, store=store_of(run_roots[0]) if run_roots else None)


def freeze_code(
    dest: Path, root: Path = PROJECT_ROOT, user: Sequence[Path] = (), script_dir: Path | None = None, skip: Sequence[Path] = (), store: Path | None = None
) -> Path:
    """Copy the sources under `root` into `dest` (created; must not exist), and the user's task
    packages (`user`: package directories or module files, see user_sources) beside them, so the
    ranks import those frozen copies too, and a script file's directory as <dest>/script (the
    ranks run the script from there); returns `dest`. Never copied: `skip` (the run root), `dest`
    itself, and what else hpc.config.freezing leaves out (run dirs, data, virtualenvs, .git).
    `store`: where unchanged files are shared between run dirs (store_of the run root)."""
    dest.mkdir(parents=True)
    skip = [*skip, dest]
    copied = sum(_copy_sources(root / package, dest / package, skip, store=store) for package in PACKAGES)  # hpc/conf with hpc
    for source in user:
        copied += _copy_sources(source, dest / source.name, skip, link_rest=True, store=store)
    if script_dir is not None:
        copied += _copy_sources(script_dir, dest / SCRIPT_DIR, skip, link_rest=True, store=store)
    commit = _git(["rev-parse", "HEAD"], root)
    diff = _git(["diff", "HEAD", "--", *PACKAGES], root) if commit else None
    if diff:
        (dest / "git.diff").write_text(diff)
    source_info = {
        "root": str(root),
        "files": copied,
        "git_commit": commit.strip() if commit else None,
        "dirty": bool(diff),
        "user": [str(source) for source in user],
        "script_dir": str(script_dir) if script_dir is not None else None,
    }
    (dest / "SOURCE.json").write_text(json.dumps(source_info, indent=2, sort_keys=True) + "\n")
    return dest
