"""Compose-time checks of command-line overrides, reported as one line naming the valid choices.

Hydra's own messages span several lines and do not list the keys a group accepts; we compose
once up front and translate its errors, using the dataclass schemas for the list of keys.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from hpc.config import JobConfig, register_schemas, to_job_config
from hpc.errors import UserError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


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


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _override_keys(overrides: list[str]) -> list[str]:
    return [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]


def explain_composition_error(err: Exception, overrides: list[str]) -> str:
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, option = str(err.missing_cfg_file).rpartition("/")
        if group and (CONF_DIR / group).is_dir():
            return f"unknown option {group}={option}; choose one of: {', '.join(group_options(group))}"
    text = " ".join(str(err).split())
    for key in _override_keys(overrides):
        if f"'{key}'" in text and ("not in" in text or "Could not override" in text or "Could not append" in text):
            found = schema_keys(key)
            if found is not None:
                parent, names = found
                where = f"'{parent}'" if parent else "the root config"
                return f"unknown key '{key}'; valid keys in {where}: {', '.join(names)}"
    cause = err.__cause__ or err
    detail = " ".join(str(cause).split("full_key:")[0].split()) or text
    full_key = getattr(cause, "full_key", None)
    return f"{full_key}: {detail}" if full_key else detail


def compose_job(overrides: list[str]) -> JobConfig:
    """Compose the typed config with these overrides (Hydra's own `hydra.*` ones are left
    out); raise UserError with one line on failure."""
    return compose_jobs([overrides])[0]


def compose_jobs(points: list[list[str]]) -> list[JobConfig]:
    """compose_job for many override lists, in one Hydra initialisation (a sweep's points)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()  # idempotent: the same node stored again
    jobs = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            for overrides in points:
                plain = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
                try:
                    jobs.append(to_job_config(compose("config", overrides=plain)))  # type errors surface here too
                except Exception as err:  # hydra and omegaconf raise many types; all become one line
                    raise UserError(explain_composition_error(err, plain)) from None
        finally:
            GlobalHydra.instance().clear()
    return jobs


def sweeper_params(overrides: list[str]) -> dict[str, str]:
    """`hydra.sweeper.params` of the config these (non-sweep) overrides compose, e.g. from
    experiment=scaling; Hydra's basic sweeper adds them to the command line's sweep."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    register_schemas()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            params = compose("config", overrides=overrides, return_hydra_config=True).hydra.sweeper.get("params")
    except Exception as err:  # as in compose_job: every failure is one line
        raise UserError(explain_composition_error(err, overrides)) from None
    finally:
        GlobalHydra.instance().clear()
    return {str(k): str(v) for k, v in (OmegaConf.to_container(params) or {}).items()} if params else {}


def check_sweep(arguments: list[str]) -> list[JobConfig]:
    """Expand a `-m` command line and compose every point; returns their configs.
    Raises UserError (one line, naming the point) for anything Hydra would refuse later."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from hpc.sweep import expand_sweep

    try:
        parsed = OverridesParser.create().parse_overrides(arguments)
    except HydraException as err:
        raise UserError(" ".join(str(err).split())) from None
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    return compose_jobs(expand_sweep(arguments, sweeper_params(fixed)))


def check_overrides(overrides: list[str]) -> JobConfig:
    """Compose the config with these overrides; raise UserError with one line on failure."""
    return compose_job(overrides)
