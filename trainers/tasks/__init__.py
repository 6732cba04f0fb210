"""Tasks by name: the built-in ones use the same seam (trainers.task.Task) as a user's own.

`build_task(spec, provided)` makes the task a config names: `spec` is the `task` config group
(`_target_`: the class as `package.module.Class`, every other key a constructor argument), and
`provided` holds what the toolkit offers a constructor that asks for it by parameter name:
`model`, `data`, `trainer` (the typed configs of those groups) and `data_path` (the built-in
data set's file). Unknown keys are refused naming the ones the class takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainers.config import CLASSIFY_TASK
from trainers.targets import TARGET_KEY, instantiate
from trainers.task import Task, adapt


def build_task(spec: Mapping[str, Any], provided: Mapping[str, Any]) -> Task:
    target = str(spec.get(TARGET_KEY) or CLASSIFY_TASK)
    return adapt(instantiate({**spec, TARGET_KEY: target}, "task", offered=provided), target)
