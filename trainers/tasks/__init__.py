"""Tasks by name: the built-in ones use the same seam (trainers.task.Task) as a user's own.

`build_task(spec, provided)` makes the task a config names: `spec` is the `task` config group
(`_target_`: the class as `package.module.Class`, every other key a constructor argument), and
`provided` holds what the toolkit offers a constructor that asks for it by parameter name:
`model`, `data`, `trainer` (the typed configs of those groups) and `data_path` (the built-in
data set's file). Unknown keys are refused naming the ones the class takes.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from trainers.config import CLASSIFY_TASK
from trainers.task import Task, TaskError, adapt

TARGET_KEY = "_target_"


def split_target(target: str) -> tuple[str, str]:
    module, _, name = target.rpartition(".")
    if not module or not name.isidentifier():
        raise TaskError(f"task._target_={target!r}: give the class as package.module.Class")
    return module, name


def task_class(target: str) -> type:
    module_name, name = split_target(target)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise TaskError(f"task._target_={target}: no module {err.name!r} on the ranks' import path") from None
    found = getattr(module, name, None)
    if not inspect.isclass(found):
        raise TaskError(f"task._target_={target}: {module_name} defines no class {name}")
    return found


def build_task(spec: Mapping[str, Any], provided: Mapping[str, Any]) -> Task:
    target = str(spec.get(TARGET_KEY) or CLASSIFY_TASK)
    cls = task_class(target)
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    given = {key: value for key, value in spec.items() if key != TARGET_KEY}
    unknown = sorted(key for key in given if key not in params and not takes_any)
    if unknown:
        takes = ", ".join(name for name in params if name not in provided) or "nothing"
        raise TaskError(f"task.{unknown[0]}: {target} takes no argument {unknown[0]!r}; it takes: {takes}")
    offered = {key: value for key, value in provided.items() if key in params and key not in given}
    try:
        return adapt(cls(**offered, **given), target)
    except TypeError as err:  # a required argument the config does not give
        raise TaskError(f"task._target_={target}: {err}") from None
