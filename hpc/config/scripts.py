"""A user's own training script as the job (`python launch.py script=train.py -- --lr 0.1`).

Three forms, as a user would start them by hand:
- a file, `script=train.py` (`python train.py`): its directory is frozen with the job and is
  the first entry of the ranks' import path, so its sibling modules (model.py) import as usual;
- a module, `script=pkg.train` (`python -m pkg.train`);
- a function, `script=pkg.train:main`, called with no arguments (sys.argv holds the script's).
A module's or function's top-level package is frozen as a task's is (hpc.launching.snapshot).

Everything here runs on the login node without importing the script (no torch there): the
file or module is found, parsed, and the function looked up in its source. The script's own
arguments travel verbatim in config.yaml; `literal` escapes what OmegaConf would read as an
interpolation (`${...}`), so `--name=${USER}` reaches the script as typed.
"""

from __future__ import annotations

import ast
import re
import shlex
import sys
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

from hpc.config.freezing import frozen_files
from hpc.config.schema import JobConfig
from hpc.config.sources import find_module_file
from hpc.env import WARM_FRAMEWORKS
from hpc.errors import UserError

SCRIPT_DIR = "script"  # a file's directory, frozen as <code>/script (hpc.launching.snapshot)
# A file's directory is frozen whole (its .py and .yaml files, hpc.config.freezing): a script in a
# home directory or at a repository's root with thousands of sources gets a clear refusal instead
# of a long copy.
MAX_FROZEN_FILES = 2000


@dataclass(frozen=True)
class Script:
    """What `script=` names: a file (absolute `path`), or a `module` with an optional `function`."""

    path: Path | None = None
    module: str | None = None
    function: str | None = None


def parse_script(spec: str, workdir: Path) -> Script:
    """`script=` as given: a path ending in .py (relative to `workdir`), `pkg.module:function` or
    `pkg.module`. UserError, one line, for anything else."""
    text = spec.strip()
    if not text:
        raise UserError("script= is empty; name a file (train.py), a module (pkg.train) or a function (pkg.train:main)")
    if text.endswith(".py") or "/" in text or text.startswith("."):
        return Script(path=(workdir / text).resolve())
    module, colon, function = text.partition(":")
    if not all(part.isidentifier() for part in module.split(".")) or (colon and not function.isidentifier()):
        raise UserError(f"script={spec}: name a file ending in .py, a module (pkg.train) or a function (pkg.train:main)")
    return Script(module=module, function=function or None)


def check_script(spec: str, workdir: Path, skip: Collection[Path] = ()) -> Script:
    """The script exists where the ranks will look, and parses; a function is defined at its
    module's top level; a file's directory is not too large to freeze (`skip`: the run root,
    left out of it). Nothing is imported. UserError, one line, naming what is wrong."""
    script = parse_script(spec, workdir)
    if script.path is not None:
        if script.path.is_dir():
            raise UserError(f"script={spec}: {script.path} is a folder; name the .py file to run in it")
        if not script.path.is_file():
            raise UserError(f"script={spec}: no such file ({script.path})")
        source_file: Path | None = script.path
        frozen = sum(1 for _ in frozen_files(script.path.parent, skip))
        if frozen > MAX_FROZEN_FILES:
            raise UserError(
                f"script={spec}: its directory {script.path.parent} holds {frozen} source files, all frozen with the job "
                f"(more than {MAX_FROZEN_FILES}); put the script and its modules in a directory of their own"
            )
    else:
        assert script.module is not None
        # The ranks run with PYTHONSAFEPATH; a module in the working directory is found as
        # `python -m` finds it, and frozen with the job like any package of the user's
        search = [*(p for p in sys.path if p), str(workdir)]
        try:
            source_file, missing = find_module_file(script.module, search)
        except (ImportError, ValueError) as err:
            raise UserError(f"script={spec}: {err}") from None
        if missing:
            where = f"on the import path or in {workdir}"
            raise UserError(f"script={spec}: no module {missing!r} {where}; put your package's parent directory on PYTHONPATH or pip install it")
        if source_file is not None and source_file.name == "__init__.py" and script.function is None:
            source_file = source_file.parent / "__main__.py"  # `python -m pkg` runs pkg/__main__.py
            if not source_file.is_file():
                raise UserError(f"script={spec}: {script.module} is a package without __main__.py; name its module (pkg.train) or a function")
    if source_file is None and script.module is not None and script.function is None and not any_main(script.module, search):
        folder = script.module.replace(".", "/")
        raise UserError(f"script={spec}: {script.module} is a folder without __init__.py or __main__.py; name a file ({folder}/train.py) or a module in it")
    if source_file is None or source_file.suffix != ".py":
        return script  # compiled or namespace: the rank's own import says more
    try:
        tree = ast.parse(source_file.read_bytes(), str(source_file))
    except OSError as err:
        raise UserError(f"script={spec}: {source_file}: {err.strerror}") from None
    except SyntaxError as err:
        raise UserError(f"script={spec}: {source_file} line {err.lineno}: {err.msg}") from None
    if script.function is not None and not any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == script.function for node in tree.body):
        raise UserError(f"script={spec}: {source_file} defines no function {script.function} at its top level")
    return script


def frameworks_imported(source: str | bytes) -> list[str]:
    """The modules the warm process imports for a script of this source (hpc.env.WARM_FRAMEWORKS),
    in the order the source first imports them, at any depth (a function's own imports too);
    none for a source that does not parse (the rank's own import says why)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from transformers import Trainer`: the lazy package's trainer module, as if named
            named = [node.module, *(f"{node.module}.trainer" for alias in node.names if alias.name.endswith("Trainer"))]
        else:
            continue
        for name in named:
            parts = name.split(".")
            warm = [above for depth in range(1, len(parts) + 1) if (above := ".".join(parts[:depth])) in WARM_FRAMEWORKS]
            found += [module for module in warm if module not in found]
    return found


def script_frameworks(spec: str, workdir: Path) -> list[str]:
    """frameworks_imported for the file `script=` runs (its module's, found without importing);
    none where there is no such Python file."""
    try:
        script = parse_script(spec, workdir)
        if script.path is not None:
            source_file: Path | None = script.path
        else:
            assert script.module is not None
            source_file, _ = find_module_file(script.module, [*(p for p in sys.path if p), str(workdir)])
        return frameworks_imported(source_file.read_bytes()) if source_file is not None and source_file.suffix == ".py" else []
    except (UserError, ImportError, ValueError, OSError):
        return []


def any_main(module: str, search: list[str]) -> bool:
    """A namespace package `module` (folders without __init__.py) has a __main__.py in one of
    its folders on the search path: what `python -m` would run."""
    relative = Path(*module.split("."))
    return any((Path(root) / relative / "__main__.py").is_file() for root in search)


def literal(value: str) -> str:
    """`value` as a string OmegaConf reads back unchanged: an interpolation's `${` is escaped,
    and so is each backslash right before it (OmegaConf's escapes act only there)."""
    return re.sub(r"(\\*)\$\{", lambda m: "\\" * (2 * len(m.group(1)) + 1) + "${", value)


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """launch.py's arguments before the first `--` (Hydra's) and after it (the script's, verbatim;
    None without a `--`)."""
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def with_script_args(job: JobConfig, script_args: list[str] | None) -> JobConfig:
    """`job` with the arguments typed after `--` (verbatim, never parsed by Hydra) for its script;
    unchanged without a `--`."""
    if script_args is None:
        return job
    if job.script is None:
        raise UserError(f"arguments after -- ({shlex.join(script_args)}) go to a script, and none is given: add script=train.py")
    return replace(job, script_args=script_args)
