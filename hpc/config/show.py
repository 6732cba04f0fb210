"""What hpc-launch prints instead of running: `--help`, `--hydra-help`, `--cfg`, `--info`,
`--version`. Hydra's own flags, printed from what Hydra's compose API composed (hydra.main
prints them through its private app runner), so they show the config the same overrides run.

Each function returns the text; hpc.app prints it.
"""

from __future__ import annotations

import string
from typing import Any

from hpc.config.compose import render_group_help, search_dirs
from hpc.errors import UserError

FLAGS_HELP = """\
key=value ...             override any config key (group=option picks an option of a group)
--help, -h                this help: the config groups and the composed config
--hydra-help              Hydra's own config groups (hydra/launcher, hydra/sweeper, ...)
--version                 the versions of this toolkit and of what it runs on
--cfg, -c job|hydra|all   print the composed config (the job's, Hydra's, or both); runs nothing
--resolve                 with --cfg: interpolations resolved
--package, -p KEY         with --cfg: that node only (optim, cluster.partition, ...)
--info, -i [WHAT]         where the config came from: all, config, defaults, searchpath, plugins
--multirun, -m            a sweep: a grid of job arrays, or a search (hydra/sweeper=optuna)
--config-path, -cp DIR    the primary config's directory, or pkg://module (default: the built-in)
--config-name, -cn NAME   the primary config (default: config)
--config-dir, -cd DIR     a project's own config dir, searched after the primary one
-- ARGS                   a single run's script arguments: script=train.py -- --lr 0.1"""

INFO_SECTIONS = ("all", "config", "defaults", "searchpath", "plugins")


def task_node(cfg: Any) -> Any:
    """The job's config: the composed one without its `hydra` node."""
    from omegaconf import OmegaConf

    return OmegaConf.masked_copy(cfg, [str(key) for key in cfg if key != "hydra"])


def app_help(cfg: Any) -> str:
    """hydra.help.template (hpc/conf/config.yaml) filled in as Hydra fills it: $FLAGS_HELP,
    $APP_CONFIG_GROUPS, $HYDRA_CONFIG_GROUPS and $CONFIG (the job's config, unresolved)."""
    from omegaconf import OmegaConf

    template = str(cfg.hydra.help.template)  # its ${...} resolved: the header, ${hpc_config_groups:}
    return string.Template(template).safe_substitute(
        FLAGS_HELP=FLAGS_HELP,
        APP_CONFIG_GROUPS=render_group_help(search_dirs()),
        HYDRA_CONFIG_GROUPS=hydra_groups(),
        CONFIG=OmegaConf.to_yaml(task_node(cfg)).rstrip(),
    )


def hydra_help() -> str:
    return f"Hydra's flags, as hpc-launch takes them:\n{FLAGS_HELP}\n\nHydra's config groups (hydra/group=option):\n{hydra_groups()}"


def hydra_groups() -> str:
    """Every group under hydra/ and its options, from the config loader's search path."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()
    lines = []
    for group in sorted(loader.list_groups("hydra")):
        options = loader.get_group_options(f"hydra/{group}", results_filter=ObjectType.CONFIG)
        lines.append(f"hydra/{group}: {', '.join(options)}")
    return "\n".join(lines)


def show_cfg(cfg: Any, part: str, package: str | None, resolve: bool) -> str:
    """`--cfg job|hydra|all [--package KEY] [--resolve]`, as Hydra prints it."""
    from omegaconf import Container, OmegaConf

    if resolve:  # in the whole config: the hydra node's interpolations name the job's keys (run_root)
        cfg = OmegaConf.create(resolved(cfg))
    node: Any = task_node(cfg) if part == "job" else OmegaConf.create({"hydra": cfg.hydra}) if part == "hydra" else cfg
    header = ""
    if package and package != "_global_":
        node = package_node(node, package, part)
        header = f"# @package {package}\n"
    if not isinstance(node, Container):
        return f"{header}{scalar_text(node)}"
    return header + OmegaConf.to_yaml(node).rstrip()


_NO_SUCH_KEY = object()


def package_node(node: Any, package: str, part: str) -> Any:
    """The node at key `package`; UserError when there is no such key. A key set to null is
    there: select's own default (None) would read it as missing, hence the sentinel."""
    from omegaconf import MissingMandatoryValue, OmegaConf

    try:
        found = OmegaConf.select(node, package, default=_NO_SUCH_KEY, throw_on_missing=True)
    except MissingMandatoryValue:  # `???`: there, but not set (without the flag select reads it as missing too)
        return "???"
    if found is _NO_SUCH_KEY:
        raise UserError(f"--package {package}: no such key in the {part} config")
    return found


def scalar_text(value: Any) -> str:
    """A selected scalar as --cfg prints it: null as YAML writes it (not Python's None)."""
    return "null" if value is None else str(value)


def resolved(cfg: Any) -> Any:
    """The config as plain containers, each interpolation resolved where it can be; one that
    cannot be outside a run (hydra.job.num before a sweep, a key that is missing) stays as written."""
    from omegaconf import Container, OmegaConf

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            return {key: walk(value, f"{path}.{key}" if path else str(key)) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value, f"{path}[{index}]") for index, value in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            try:
                value = OmegaConf.select(cfg, path, throw_on_missing=True)
            except Exception:  # omegaconf's many errors: the value stays as written
                return node
            return OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value
        return node

    return walk(OmegaConf.to_container(cfg, resolve=False), "")


def show_info(cfg: Any, what: str) -> str:
    """`--info [all|config|defaults|searchpath|plugins]`."""
    sections = {"searchpath": search_path, "defaults": defaults, "plugins": plugins, "config": lambda _: show_cfg(cfg, "job", None, False)}
    chosen = list(sections) if what == "all" else [what]
    return "\n\n".join(f"== {name} ==\n{sections[name](cfg)}" for name in chosen)


def search_path(_: Any) -> str:
    from hydra.core.global_hydra import GlobalHydra

    entries = GlobalHydra.instance().config_loader().get_search_path().get_path()
    return "\n".join(f"{entry.provider or '':<16} {entry.path}" for entry in entries)


def defaults(cfg: Any) -> str:
    """The option each config group got (hydra.runtime.choices)."""
    choices = cfg.hydra.runtime.choices
    width = max((len(str(group)) for group in choices), default=0)
    return "\n".join(f"{str(group):<{width}}  {option}" for group, option in sorted(choices.items(), key=lambda item: str(item[0])))


def plugins(_: Any) -> str:
    from hydra.core.plugins import Plugins
    from hydra.plugins.plugin import Plugin

    found = Plugins.instance().discover(Plugin)
    return "\n".join(sorted(f"{cls.__module__}.{cls.__name__}" for cls in found))


def version() -> str:
    from importlib import metadata  # 20 ms: only --version needs it

    def of(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"hpc-launch {of('hpc-toolkit')} (Hydra {of('hydra-core')}, omegaconf {of('omegaconf')}, submitit {of('submitit')})"
