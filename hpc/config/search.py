"""`launch.py -m` with a sweeper that searches (Optuna, Nevergrad, Ax): the checks before Hydra
runs it.

Such a sweeper picks its points as results come in, so they cannot all be composed up front as
the basic sweeper's grid is. What can be: every edge of the search space. Each choice, each
value of a range and both ends of an interval is composed (the other keys at their first value)
and validated, so a value no trial could run with is refused before anything is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc.config.compose import ARRAY_LAUNCHER, DEFAULT_SOURCE, ConfigSource, compose_jobs, remember_composed, sweeper_params
from hpc.config.schema import JobConfig, task_target
from hpc.errors import UserError
from hpc.objective import check_objective, objective_direction
from trainers.config import CLASSIFY_TASK, LM_TASK

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
# Optuna's sweeper with a study that outlives the launcher (hydra_plugins/hpc_array_launcher/study.py)
STUDY_SWEEPER = "hydra_plugins.hpc_array_launcher.study.StudySweeper"
# A trial's run is set by these; a search that varied them could not be one array, or one study.
FIXED_PREFIXES = ("cluster", "dry_run", "sweep.", "sweep=", "run_root", "wait", "hydra.", "hydra/")
MAX_EDGE_VALUES = 16  # of a long range: its first and last values stand for the rest
BUILTIN_TASKS = {CLASSIFY_TASK: "classify", LM_TASK: "lm"}


@dataclass(frozen=True)
class Search:
    """A searching sweeper's run, as launch.py checked it."""

    sweeper: str  # its short name: "optuna"
    objective: str
    direction: str | None  # "maximize" / "minimize" where the sweeper or the objective says
    points: list[tuple[list[str], JobConfig]]  # the search space's edges, composed


def is_basic(sweeper: dict[str, Any]) -> bool:
    return str(sweeper.get("_target_", BASIC_SWEEPER)) == BASIC_SWEEPER


def sweeper_name(target: str) -> str:
    """hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper -> optuna."""
    module = target.split(".")[1] if target.startswith("hydra_plugins.") and target.count(".") >= 2 else target
    return module.removeprefix("hydra_").removesuffix("_sweeper")


def edge_values(override: Any) -> list[str]:
    """The values of one sweep override that stand for all it can take (see the module doc)."""
    from hydra.core.override_parser.types import IntervalSweep

    value = override.value()
    if isinstance(value, IntervalSweep):
        return [str(value.start), str(value.end)]
    values = list(override.sweep_string_iterator())
    return values if len(values) <= MAX_EDGE_VALUES else [values[0], values[-1]]


def edge_points(arguments: list[str], sweeper: dict[str, Any]) -> list[list[str]]:
    """Override lists that visit every edge value of every searched key once."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    params = [f"{key}={value}" for key, value in sweeper_params(sweeper).items()]
    try:
        parsed = OverridesParser.create().parse_overrides([*params, *arguments])
        searched = {o.get_key_element(): edge_values(o) for o in parsed if o.is_sweep_override()}
    except HydraException as err:
        raise UserError(" ".join(str(err).split())) from None
    for key in searched:
        if key.lstrip("+~").startswith(FIXED_PREFIXES):
            raise UserError(f"{key} cannot be searched: it is the same for every trial of a search (set it once, outside the search space)")
    fixed = [o.input_line for o in parsed if not o.is_sweep_override() and o.input_line is not None]
    first = {key: values[0] for key, values in searched.items() if values}
    points = [[*fixed, *(f"{k}={v}" for k, v in first.items())]]
    for key, values in searched.items():
        points += [[*fixed, *(f"{k}={value if k == key else v}" for k, v in first.items())] for value in values[1:]]
    return points


def check_search(arguments: list[str], sweeper: dict[str, Any], source: ConfigSource = DEFAULT_SOURCE) -> Search:
    """Compose the search space's edges and check what the launcher must honour. UserError (one
    line) for a search it cannot run."""
    name = sweeper_name(str(sweeper.get("_target_")))
    if sweeper.get("launcher") != ARRAY_LAUNCHER:
        raise UserError(f"hydra/sweeper={name} runs through this toolkit's launcher only: leave hydra/launcher at hpc_array")
    overrides = edge_points(arguments, sweeper)
    points = list(zip(overrides, compose_jobs(overrides, source), strict=True))
    remember_composed(points)
    first = points[0][1]
    objective = first.sweep.objective
    if not objective:
        raise UserError(f"hydra/sweeper={name} needs the figure each trial returns: set sweep.objective (for example sweep.objective=val_accuracy)")
    builtin = BUILTIN_TASKS.get(task_target(first))
    problem = check_objective(objective, builtin)
    if problem:
        raise UserError(problem)
    if len({job.cluster.launcher for _, job in points}) > 1:
        raise UserError("a search runs on one cluster: every trial's cluster must be the same")
    if isinstance(sweeper.get("direction"), list) and len(sweeper["direction"]) > 1:
        raise UserError(f"hydra.sweeper.direction lists {len(sweeper['direction'])} directions, but sweep.objective names one figure: give one direction")
    if str(dict(sweeper.get("sampler") or {}).get("_target_", "")).endswith("GridSampler"):
        raise UserError("hydra/sweeper/sampler=grid: a grid needs no results; sweep it with the default sweeper (-m key=a,b,c), one job array")
    wanted = objective_direction(objective)
    direction = sweeper_direction(sweeper)
    if wanted and direction and wanted != direction:
        better = "higher" if wanted == "maximize" else "lower"
        raise UserError(f"sweep.objective={objective} is better {better}, but hydra.sweeper.direction={direction}: set hydra.sweeper.direction={wanted}")
    return Search(name, objective, direction or wanted, points)


def search_arguments(argv: list[str]) -> list[str]:
    """A search's command line as sweep.json keeps it, to tell the same study from another one:
    without the flags and keys that may change when the study is continued."""
    loose = ("hydra.sweep.dir=", "hydra.sweeper.n_trials=", "hydra.sweeper._target_=")
    return [a for a in argv if a not in ("-m", "--multirun") and not a.startswith(loose)]


def sweeper_direction(sweeper: dict[str, Any]) -> str | None:
    """Optuna's `direction` (one objective); None for sweepers that name it otherwise."""
    direction = sweeper.get("direction")
    name = str(getattr(direction, "name", direction)).rpartition(".")[2].lower()  # an enum, or "maximize"
    return name if name in ("maximize", "minimize") else None
