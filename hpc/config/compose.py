"""Compose-time checks of command-line overrides, reported as one line naming the valid choices.

Hydra's own messages span several lines and do not list the keys a group accepts; we compose
once up front and translate its errors, using the dataclass schemas for the list of keys.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc.config.local_gpus import local_job, machine_gpus
from hpc.config.schema import JobConfig, unknown_key_message
from hpc.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # package data: found installed or in a checkout
ARRAY_LAUNCHER = "hpc.launching.sweep.launch_sweep"  # hydra/launcher=hpc_array: named in Hydra's config; hpc-launch calls it, Hydra never does


_registered = False


def register_schemas() -> None:
    """Once per process: storing the schema converts the dataclasses, 20-40 ms each time."""
    global _registered
    if _registered:
        return
    _registered = True
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="job_schema", node=JobConfig)
    # conf/config.yaml selects our launcher; registering its config here too keeps composition
    # working in processes that cannot discover Hydra plugins (ranks, workers started elsewhere).
    store.store(group="hydra/launcher", name="hpc_array", node={"_target_": ARRAY_LAUNCHER}, provider="hpc-toolkit")


def load_plugins() -> None:
    """Hydra imports every installed Hydra plugin before anything else; one that fails to import
    (hydra-ax-sweeper 1.2.0 on Python 3.11) would end every command with a traceback."""
    import sys

    from hydra.core.plugins import Plugins

    try:
        Plugins.instance()
    except Exception as err:
        module = failing_plugin() or "a module under hydra_plugins"
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        cause = f"{type(err).__name__}: {err}"
        fix = f"uninstall its package, or install a release that supports Python {python}"
        raise UserError(f"the installed Hydra plugin {module} fails to import ({cause}): {fix}") from None


def failing_plugin() -> str | None:
    """The first module under the hydra_plugins namespace that fails to import (as Hydra's own
    scan imports them all)."""
    import importlib
    import pkgutil

    try:
        import hydra_plugins
    except ImportError:
        return None
    for found in pkgutil.walk_packages(hydra_plugins.__path__, "hydra_plugins.", onerror=lambda name: None):
        try:
            importlib.import_module(found.name)
        except Exception:
            return found.name
    return None


@dataclass(frozen=True)
class ConfigSource:
    """Where the primary config comes from: launch.py's defaults, or its Hydra flags
    --config-path/-cp (a directory, or pkg://module), --config-name/-cn, --config-dir/-cd
    (one more directory searched after the primary one)."""

    config_path: str = str(CONF_DIR)
    config_name: str = "config"
    config_dir: str | None = None

    def group_dirs(self, group: str) -> list[Path]:
        roots = [Path(p) for p in (self.config_path, self.config_dir) if p and not p.startswith("pkg://")]
        return [root / group for root in roots if (root / group).is_dir()]

    def dirs(self) -> tuple[str, str | None]:
        """(the directory the compose API starts from, the one more it searches). Hydra finds the
        primary config before it reads `hydra.searchpath`, so a primary config that only the
        --config-dir holds makes that the first directory (its options then come first too)."""
        name = self.config_name if self.config_name.endswith(".yaml") else f"{self.config_name}.yaml"
        if self.config_dir is not None and not self.config_path.startswith("pkg://"):
            if not (Path(self.config_path) / name).is_file() and (Path(self.config_dir) / name).is_file():
                return self.config_dir, self.config_path
        return self.config_path, self.config_dir

    def search_overrides(self) -> list[str]:
        """--config-dir as the compose API takes it: Hydra's documented `hydra.searchpath`, which
        puts the directory after the primary config's, where Hydra's flag puts it."""
        extra = self.dirs()[1]
        if extra is None:
            return []
        quoted = "'" + f"file://{extra}".replace("'", "\\'") + "'"  # any path: spaces, commas, brackets
        return [f"hydra.searchpath=[{quoted}]"]


DEFAULT_SOURCE = ConfigSource()


@contextmanager
def initialized(source: ConfigSource) -> Iterator[None]:
    """Hydra's compose API set up for the primary config `launch.py` with these flags gets
    (compose with source.search_overrides() for --config-dir)."""
    from hydra import initialize_config_dir, initialize_config_module

    register_schemas()  # idempotent: the same node stored again
    context: Any
    primary = source.dirs()[0]
    if primary.startswith("pkg://"):
        context = initialize_config_module(config_module=primary.removeprefix("pkg://").replace("/", "."), version_base="1.3", job_name="launch")
    else:
        context = initialize_config_dir(config_dir=primary, version_base="1.3", job_name="launch")
    with context:
        yield


HELP_MARK = "# help:"  # in an option's leading comments: its one-line description in --help


def option_help(path: Path) -> str:
    """The `# help: ...` line among a config file's leading comments; '' without one."""
    for line in path.read_text().splitlines():
        if line.startswith(HELP_MARK):
            return line.removeprefix(HELP_MARK).strip()
        if line.strip() and not line.startswith("#"):
            break
    return ""


def search_dirs() -> list[Path]:
    """The file-system config dirs Hydra searches now (the primary one and --config-dir), in
    priority order; conf/ when Hydra is not initialised."""
    from hydra.core.global_hydra import GlobalHydra

    hydra = GlobalHydra.instance()
    if not hydra.is_initialized():
        return [CONF_DIR]
    paths = [e.path.removeprefix("file://") for e in hydra.config_loader().get_search_path().get_path() if e.path]
    return [Path(p) for p in paths if "://" not in p]  # file dirs; not pkg:// nor structured://


def render_group_help(dirs: list[Path]) -> str:
    """Every config group, each option on its own line with its description (`# help:`)."""
    groups: dict[str, dict[str, str]] = {}
    for root in dirs:
        for path in sorted(root.glob("*/*.yaml")):
            if path.parent.name != "hydra":
                groups.setdefault(path.parent.name, {}).setdefault(path.stem, option_help(path))
    width = max((len(option) for options in groups.values() for option in options), default=0)
    lines = []
    for group, options in sorted(groups.items()):
        lines.append(f"{group}:")
        lines += [f"  {option:<{width}}  {text}".rstrip() for option, text in sorted(options.items())]
    return "\n".join(lines)


def schema_keys(dotted: str) -> tuple[str, list[str]] | None:
    """For 'optim.lrr': ('optim', [the OptimConfig fields]). None when no schema owns the path."""
    node: Any = JobConfig
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return None
        names = [f.name for f in dataclasses.fields(node)]
        if part not in names:
            return ".".join(parts[:depth]), names
        node = typing.get_type_hints(node)[part]
    return None


def group_options(group: str, source: ConfigSource = DEFAULT_SOURCE) -> list[str]:
    return sorted({p.stem for d in source.group_dirs(group) for p in d.glob("*.yaml")})


def _override_keys(overrides: list[str]) -> list[str]:
    return [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]


def explain_composition_error(err: Exception, overrides: list[str], source: ConfigSource = DEFAULT_SOURCE) -> str:
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, option = str(err.missing_cfg_file).rpartition("/")
        if group and source.group_dirs(group):
            return f"unknown option {group}={option}; choose one of: {', '.join(group_options(group, source))}"
    text = " ".join(str(err).split())
    for key in _override_keys(overrides):
        if f"'{key}'" in text and ("not in" in text or "Could not override" in text or "Could not append" in text):
            found = schema_keys(key)
            if found is not None:
                return unknown_key_message(key, *found)
    cause = err.__cause__ or err
    detail = " ".join(str(cause).split("full_key:")[0].split()) or text
    full_key = getattr(cause, "full_key", None)
    append = text.partition("To append to your config use ")[2].split(" ")[0]  # Hydra's hint for a new key
    detail += f"; to add it, write {append}" if append else ""
    return f"{full_key}: {detail}" if full_key else detail


def compose_job(overrides: list[str], source: ConfigSource = DEFAULT_SOURCE) -> JobConfig:
    """Compose the typed config with these overrides (Hydra's own `hydra.*` ones are left
    out), as it runs here (cluster=local: on this machine's GPUs, hpc.config.local_gpus); raise
    UserError with one line on failure."""
    return compose_jobs([overrides], source)[0]


def compose_jobs(points: list[list[str]], source: ConfigSource = DEFAULT_SOURCE) -> list[JobConfig]:
    """compose_job for many override lists, in one Hydra initialisation (a sweep's points)."""
    from hydra import compose
    from hydra.errors import MissingConfigException

    jobs = []
    gpus = functools.cache(machine_gpus)  # counted once for all the points (where a point runs locally)
    try:
        with initialized(source):
            for overrides in points:
                plain = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
                try:
                    composed = compose(source.config_name, overrides=[*plain, *source.search_overrides()])
                    jobs.append(local_job(composed, plain, gpus)[0])  # type errors surface here too
                except UserError:
                    raise  # already one line (a key `+key=value` added that no schema declares)
                except Exception as err:  # hydra and omegaconf raise many types; all become one line
                    parsed_overrides(plain)  # bad syntax: named, one override at a time (else explained as Hydra says it)
                    raise UserError(explain_composition_error(err, plain, source)) from None
    except MissingConfigException as err:  # the primary config itself (--config-name, --config-path)
        raise UserError(f"{' '.join(str(err).split())} (--config-name={source.config_name}, --config-path={source.config_path})") from None
    return jobs


def compose_run(overrides: list[str], source: ConfigSource = DEFAULT_SOURCE) -> Any:
    """The whole config of one run (`hydra` node included, command-line `hydra.*` overrides
    applied), inside `initialized(source)`; UserError, one line."""
    from hydra import compose
    from hydra.errors import MissingConfigException

    try:
        return compose(source.config_name, overrides=[*overrides, *source.search_overrides()], return_hydra_config=True)
    except MissingConfigException as err:
        group, _, option = str(err.missing_cfg_file or "").rpartition("/")
        if group == "hydra/sweeper":
            raise UserError(f"hydra/sweeper={option}: hpc-launch runs grids (the default sweeper) and Optuna searches (hydra/sweeper=optuna)") from None
        if err.missing_cfg_file == source.config_name or not str(err.missing_cfg_file or "").count("/"):
            raise UserError(f"{' '.join(str(err).split())} (--config-name={source.config_name}, --config-path={source.config_path})") from None
        raise UserError(explain_composition_error(err, overrides, source)) from None
    except Exception as err:  # hydra and omegaconf raise many types; all become one line
        parsed_overrides(overrides)  # bad syntax: named, one override at a time
        raise UserError(explain_composition_error(err, overrides, source)) from None


def sweeper_config(overrides: list[str], source: ConfigSource = DEFAULT_SOURCE) -> dict[str, Any]:
    """The `hydra.sweeper` node (unresolved) of the config these (non-sweep) overrides compose,
    with `hydra.launcher._target_` under "launcher". Its `params` (e.g. from experiment=scaling)
    join the command line's sweep, as Hydra's sweepers do."""
    return sweeper_of(multirun_config(overrides, source))


def multirun_config(overrides: list[str], source: ConfigSource = DEFAULT_SOURCE) -> Any:
    """The whole config (`hydra` node included) that a sweep's non-sweep overrides compose;
    UserError, one line."""
    with initialized(source):
        return compose_run(overrides, source)


def sweeper_of(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(cfg.hydra.sweeper, resolve=False)
    sweeper = {str(k): v for k, v in node.items()} if isinstance(node, dict) else {}
    return {**sweeper, "launcher": str(cfg.hydra.launcher.get("_target_", ""))}


def sweeper_params(sweeper: dict[str, Any]) -> dict[str, str]:
    params = sweeper.get("params")
    return {str(k): str(v) for k, v in params.items()} if isinstance(params, dict) else {}


def parsed_overrides(arguments: Sequence[str]) -> list[Any]:
    """Hydra's parse of the overrides, one at a time so that a bad one is named (Hydra's own
    message names none); UserError, one line. A sweep written with a space after a comma
    (`optim.lr=0.05, 0.1`: two arguments to the shell) gets the way to write it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed: list[Any] = []
    for index, argument in enumerate(arguments):
        try:
            parsed.extend(parser.parse_overrides([argument]))
        except HydraException as err:
            split = argument.endswith(",") or ("=" not in argument and index > 0 and arguments[index - 1].endswith(","))
            hint = "; a sweep's values are separated by commas without spaces (optim.lr=0.05,0.1,0.2), or the override is quoted" if split else ""
            raise UserError(f"override {argument!r}: {' '.join(str(err).split())}{hint}") from None
    return parsed


def fixed_overrides(arguments: list[str]) -> list[str]:
    """The command line's overrides that are no sweeps (`a=1`, not `a=1,2` nor `interval(..)`)."""
    return [o.input_line for o in parsed_overrides(arguments) if not o.is_sweep_override() and o.input_line is not None]


def expand_sweep(arguments: Sequence[str], sweeper_params: dict[str, str] | None = None) -> list[list[str]]:
    """Hydra's grid expansion of `-m` arguments (and of `hydra.sweeper.params`, as Hydra's basic
    sweeper does): one override list per point. Raises UserError for bad syntax or no points."""
    import itertools

    from hydra.errors import HydraException

    params = [f"{key}={value}" for key, value in (sweeper_params or {}).items()]
    parsed = parsed_overrides([*params, *arguments])
    try:
        choices = [
            [f"{o.get_key_element()}={value}" for value in o.sweep_string_iterator()]
            if o.is_sweep_override()
            else [f"{o.get_key_element()}={o.get_value_element_as_str()}"]
            for o in parsed
        ]
    except HydraException as err:
        raise UserError(" ".join(str(err).split())) from None
    points = [list(point) for point in itertools.product(*choices)]  # the basic sweeper's order: the last key varies fastest
    if not points:
        empty = [str(o.input_line) for o in parsed if o.is_sweep_override() and not list(o.sweep_string_iterator())]
        raise UserError(f"empty sweep: {', '.join(empty) or 'the sweep'} expands to no values")
    return points


def sweep_points(arguments: list[str], source: ConfigSource = DEFAULT_SOURCE, sweeper: dict[str, Any] | None = None) -> list[tuple[list[str], JobConfig]]:
    """Expand a `-m` command line and compose every point: (the point's overrides, its config)
    in Hydra's job order. Raises UserError (one line) for anything Hydra would refuse later.
    `sweeper`: its sweeper_config, when the caller has it already."""
    if sweeper is None:
        sweeper = sweeper_config(fixed_overrides(arguments), source)
    points = expand_sweep(arguments, sweeper_params(sweeper))
    return list(zip(points, compose_jobs(points, source), strict=True))
