"""`hpc-launch -m hydra/sweeper=optuna`: a search, and the checks before its first trial.

Such a sweeper picks its points as results come in, so they cannot all be composed up front as
the basic sweeper's grid is. What can be: every edge of the search space. Each choice, each
value of a range and both ends of an interval is composed (the other keys at their first value)
and validated, so a value no trial could run with is refused before anything is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from hpc.config.compose import ARRAY_LAUNCHER, DEFAULT_SOURCE, ConfigSource, compose_jobs, parsed_overrides, sweeper_params
from hpc.config.schema import JobConfig, task_target
from hpc.errors import UserError
from hpc.objective import check_objective, objective_direction
from trainers.config import CLASSIFY_TASK, LM_TASK

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"  # a name in Hydra's config, never imported
# hpc/conf/hydra/sweeper/optuna.yaml: Optuna's study API driven by hpc.launching.study (not a Hydra plugin)
OPTUNA_STUDY = "hpc.launching.study.run_study"
# A trial's run is set by these; a search that varied them could not be one array, or one study.
FIXED_PREFIXES = ("cluster", "dry_run", "sweep.", "sweep=", "run_root", "wait", "hydra.", "hydra/")
MAX_EDGE_VALUES = 16  # of a long range: its first and last values stand for the rest
BUILTIN_TASKS = {CLASSIFY_TASK: "classify", LM_TASK: "lm"}


@dataclass(frozen=True)
class Search:
    """A searching sweeper's run, as launch.py checked it."""

    sweeper: str  # its short name: "optuna"
    objective: str
    direction: str  # "maximize" / "minimize": the sweeper's, else the objective's
    points: list[tuple[list[str], JobConfig]]  # the search space's edges, composed
    settings: StudySettings
    space: dict[str, Any]  # each searched key's Optuna distribution
    fixed: list[str]  # the overrides every trial shares
    sampler: Any  # an optuna.samplers.BaseSampler, made from hydra.sweeper.sampler


def is_basic(sweeper: dict[str, Any]) -> bool:
    return str(sweeper.get("_target_", BASIC_SWEEPER)) == BASIC_SWEEPER


def sweeper_name(target: str) -> str:
    """hydra_plugins.hydra_nevergrad_sweeper.nevergrad_sweeper.NevergradSweeper -> nevergrad."""
    if target == OPTUNA_STUDY:
        return "optuna"
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


def parsed_search(arguments: list[str], sweeper: dict[str, Any]) -> list[Any]:
    """hydra.sweeper.params, then the command line, through Hydra's override parser (the later
    of a key's two wins where it matters); UserError, one line, for bad syntax."""
    params = [f"{key}={value}" for key, value in sweeper_params(sweeper).items()]
    return parsed_overrides([*params, *arguments])


def edge_points(arguments: list[str], sweeper: dict[str, Any]) -> list[list[str]]:
    """Override lists that visit every edge value of every searched key once."""
    from hydra.errors import HydraException

    parsed = parsed_search(arguments, sweeper)
    try:
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


@dataclass(frozen=True)
class StudySettings:
    """hydra.sweeper of hydra/sweeper=optuna (hpc/conf/hydra/sweeper/optuna.yaml): the keys and
    meaning of hydra-optuna-sweeper's config, run on Optuna's own study API."""

    sampler: dict[str, Any]  # instantiated with hydra.utils.instantiate: _target_ and its arguments
    direction: str | None
    study_name: str
    storage: str | None  # None: sqlite in the sweep dir
    n_trials: int
    n_jobs: int
    max_failure_rate: float


def study_settings(sweeper: dict[str, Any]) -> StudySettings:
    """The sweeper node checked, each problem one line naming its key."""
    direction = sweeper.get("direction")
    if isinstance(direction, list | tuple):
        if len(direction) > 1:
            raise UserError(f"hydra.sweeper.direction lists {len(direction)} directions, but sweep.objective names one figure: give one direction")
        direction = direction[0] if direction else None
    if direction is not None and str(direction) not in ("maximize", "minimize"):
        raise UserError(f"hydra.sweeper.direction={direction}: choose maximize or minimize")
    whole = {key: sweeper.get(key) for key in ("n_trials", "n_jobs")}
    for key, value in whole.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"hydra.sweeper.{key}={value} must be a whole number >= 1")
    rate = sweeper.get("max_failure_rate", 0.0)
    if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0.0 <= rate <= 1.0:
        raise UserError(f"hydra.sweeper.max_failure_rate={rate} must be a fraction from 0 to 1")
    sampler = sweeper.get("sampler") or {}
    if not isinstance(sampler, dict) or not sampler.get("_target_"):
        raise UserError("hydra.sweeper.sampler needs a _target_: choose one with hydra/sweeper/sampler=tpe (or random, cmaes, nsgaii, qmc)")
    storage, name = sweeper.get("storage"), sweeper.get("study_name")
    return StudySettings(
        sampler={str(k): v for k, v in sampler.items()},
        direction=None if direction is None else str(direction),
        study_name=str(name) if name else DEFAULT_STUDY,
        storage=str(storage) if storage else None,
        n_trials=int(whole["n_trials"] or 0),
        n_jobs=int(whole["n_jobs"] or 0),
        max_failure_rate=float(rate),
    )


DEFAULT_STUDY = "search"


def check_search(arguments: list[str], sweeper: dict[str, Any], source: ConfigSource = DEFAULT_SOURCE) -> Search:
    """Compose the search space's edges and check what the launcher must honour. UserError (one
    line) for a search it cannot run."""
    import importlib.util

    target = str(sweeper.get("_target_"))
    name = sweeper_name(target)
    if target != OPTUNA_STUDY:
        raise UserError(f"hydra/sweeper={name}: hpc-launch runs grids (the default sweeper) and Optuna searches (hydra/sweeper=optuna)")
    if sweeper.get("launcher") != ARRAY_LAUNCHER:
        raise UserError(f"hydra/sweeper={name} runs through this toolkit's launcher only: leave hydra/launcher at hpc_array")
    if importlib.util.find_spec("optuna") is None:
        raise UserError("hydra/sweeper=optuna needs Optuna: pip install 'hpc-toolkit[optuna]'")
    settings = study_settings(sweeper)
    if str(settings.sampler["_target_"]).endswith("GridSampler"):
        raise UserError("hydra/sweeper/sampler=grid: a grid needs no results; sweep it with the default sweeper (-m key=a,b,c), one job array")
    space, fixed = search_space(arguments, sweeper)
    sampler = make_sampler(settings.sampler)
    overrides = edge_points(arguments, sweeper)
    points = list(zip(overrides, compose_jobs(overrides, source), strict=True))
    first = points[0][1]
    objective = first.sweep.objective
    if not objective:
        raise UserError(f"hydra/sweeper={name} needs the figure each trial returns: set sweep.objective (for example sweep.objective=val_accuracy)")
    builtin = None if first.script else BUILTIN_TASKS.get(task_target(first))  # a script reports what it logs
    problem = check_objective(objective, builtin)
    if problem:
        raise UserError(problem)
    if len({job.cluster.launcher for _, job in points}) > 1:
        raise UserError("a search runs on one cluster: every trial's cluster must be the same")
    wanted = objective_direction(objective)
    direction = settings.direction
    if wanted and direction and wanted != direction:
        better = "higher" if wanted == "maximize" else "lower"
        raise UserError(f"sweep.objective={objective} is better {better}, but hydra.sweeper.direction={direction}: set hydra.sweeper.direction={wanted}")
    chosen = direction or wanted
    if chosen is None:
        raise UserError(f"sweep.objective={objective}: say whether higher or lower is better, hydra.sweeper.direction=maximize or minimize")
    return Search(name, objective, chosen, points, settings, space, fixed, sampler)


def make_sampler(config: dict[str, Any]) -> Any:
    """hydra.sweeper.sampler, instantiated; UserError, one line, for one that cannot be made."""
    import importlib.util
    import warnings

    from hydra.utils import instantiate
    from optuna.exceptions import ExperimentalWarning

    if str(config["_target_"]).endswith("CmaEsSampler") and importlib.util.find_spec("cmaes") is None:
        raise UserError("hydra/sweeper/sampler=cmaes needs the cmaes package: pip install cmaes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)  # QMCSampler's: the choice is the user's
            return instantiate(config)
    except Exception as err:  # a sampler's own package missing (cmaes), a bad argument
        cause = err.__cause__ or err
        raise UserError(f"hydra.sweeper.sampler ({config['_target_']}): {' '.join(str(cause).split())}") from None


def search_space(arguments: list[str], sweeper: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The Optuna distribution of each searched key, and the overrides every trial shares, from
    hydra.sweeper.params and the command line (the later of a key's two wins), as
    hydra-optuna-sweeper reads them: `a,b` and choice() are categorical; interval() is a float or
    int range (tag(log, ...) samples its log); range() is the int (or float) grid of its values,
    its stop left out as Hydra's range leaves it out."""
    from hydra.core.override_parser.types import IntervalSweep, RangeSweep, Transformer
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    parsed = parsed_search(arguments, sweeper)
    entries: dict[str, Any] = {}
    for override in parsed:
        key = override.get_key_element()
        entries.pop(key, None)  # the later one wins, and takes the later place
        if not override.is_sweep_override():
            entries[key] = str(override.input_line)
            continue
        value: Any = override.value()
        try:
            if isinstance(value, IntervalSweep):
                log = "log" in value.tags
                whole = isinstance(value.start, int) and isinstance(value.end, int)
                low, high = cast(float, value.start), cast(float, value.end)
                entries[key] = IntDistribution(int(low), int(high), log=log) if whole else FloatDistribution(float(low), float(high), log=log)
            elif isinstance(value, RangeSweep) and not value.shuffle:
                values: list[Any] = list(override.sweep_iterator())
                if not values:
                    raise UserError(f"{override.input_line} holds no values")
                low, high, step = min(values), max(values), abs(value.step)
                if all(isinstance(v, int) for v in values) and isinstance(step, int):
                    entries[key] = IntDistribution(int(low), int(high), step=step)
                else:
                    entries[key] = FloatDistribution(float(low), float(high), step=float(step))
            else:
                choices: list[Any] = list(override.sweep_iterator(transformer=Transformer.encode))
                if not choices:
                    raise UserError(f"{override.input_line} holds no values")
                entries[key] = CategoricalDistribution(choices)
        except ValueError as err:  # Optuna's own checks: low > high, log of a range reaching 0 ...
            raise UserError(f"{override.input_line}: {err}") from None
    job_keys = [key for key in entries if not key.lstrip("+~").startswith(("hydra.", "hydra/"))]  # Hydra's own are not the job's
    fixed = [entries[key] for key in job_keys if isinstance(entries[key], str)]
    return {key: dist for key, dist in entries.items() if not isinstance(dist, str)}, fixed


def search_arguments(argv: list[str]) -> list[str]:
    """A search's command line as sweep.json keeps it, to tell the same study from another one:
    without the flags and keys that may change when the study is continued."""
    loose = ("hydra.sweep.dir=", "hydra.sweeper.n_trials=", "hydra.sweeper._target_=")
    return [a for a in argv if a not in ("-m", "--multirun") and not a.startswith(loose)]
