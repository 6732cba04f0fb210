"""The scheduler plugins: one per batch scheduler, both halves of it behind one name.

A plugin names, as "module:attribute" strings loaded only when asked for:
- `traits`: its LauncherTraits (hpc.config.launchers: what the login node's checks ask of it);
- `launcher`: its QueuedLauncher class (hpc.launching.launchers: render, submit, arrays, state,
  cancel, signal, wait, dependencies);
- `environment`: its rank environment (hpc.env.SchedulerEnvironment: is this one of my jobs,
  which rank is this task, the job's nodes, restarts, rendezvous);
- `job`: the class the ranks ask after a stop (hpc.rank.scheduler.Scheduler: requeue, markers,
  the resume command), built from the process environment.

Found by name: Slurm is built in (hpc.slurm, the only package that runs Slurm's tools); another
package adds one with an entry point in group `hpc.schedulers` whose object is a SchedulerPlugin
(`[project.entry-points."hpc.schedulers"] pbs = "hpc_pbs.plugin:PLUGIN"`). Nothing outside a
plugin names a scheduler: the launchers' table, the traits' table, the rank environment and the
ranks' scheduler all come from here. The standard library and hpc.errors only: the login node, the batch script
and every rank import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any

from hpc.errors import UserError

ENTRY_POINT_GROUP = "hpc.schedulers"
RESERVED = ("local",)  # a launcher name taken by the toolkit itself (mpirun on this machine)


class SchedulerPluginError(UserError):
    """A plugin that cannot be loaded: the message is one line naming it."""


@dataclass(frozen=True)
class SchedulerPlugin:
    name: str  # cluster.launcher's value, and job.json's "launcher"
    traits: str
    launcher: str
    environment: str
    job: str

    def load(self, part: str) -> Any:
        """The object `part` ("traits", "launcher", "environment" or "job") names, imported now."""
        target = getattr(self, part)
        module, _, attribute = target.partition(":")
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as err:
            raise SchedulerPluginError(f"scheduler plugin {self.name!r}: its {part} {target!r} cannot be loaded ({type(err).__name__}: {err})") from None


BUILT_IN = (
    SchedulerPlugin(
        "slurm",
        traits="hpc.slurm.options:TRAITS",
        launcher="hpc.slurm.launcher:SlurmLauncher",
        environment="hpc.slurm.environment:SLURM",
        job="hpc.slurm.job:SlurmJob",
    ),
)


def _named(point: Any) -> str:
    return f"scheduler plugin entry point {point.name} = {point.value}"


@cache
def plugins() -> dict[str, SchedulerPlugin]:
    """Every scheduler plugin by name: the built-in ones, then those installed packages declare
    (read once per process)."""
    from importlib.metadata import entry_points  # 15 ms to import, as long to scan: only where asked

    found = {plugin.name: plugin for plugin in BUILT_IN}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            plugin = point.load()
        except Exception as err:  # a broken third-party package: named, not a traceback
            raise SchedulerPluginError(f"{_named(point)} cannot be loaded ({type(err).__name__}: {err})") from None
        if not isinstance(plugin, SchedulerPlugin):
            raise SchedulerPluginError(f"{_named(point)} is a {type(plugin).__name__}, not a hpc.schedulers.SchedulerPlugin")
        if plugin.name in found or plugin.name in RESERVED:
            raise SchedulerPluginError(f"{_named(point)} takes the name {plugin.name!r}, which is taken")
        found[plugin.name] = plugin
    return found


def built_in_first() -> list[str]:
    """The plugins' names, the built-in ones first: a job one of them claims is told without
    looking up the installed packages."""
    return [plugin.name for plugin in BUILT_IN]


@cache
def loaded(name: str, part: str) -> Any:
    """The plugin's `part`, loaded once per process."""
    plugin = next((p for p in BUILT_IN if p.name == name), None) or plugins()[name]
    return plugin.load(part)
