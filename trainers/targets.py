"""Classes a config names by Hydra's `_target_` convention, made on the rank: the task, a custom
optimizer, a custom learning-rate scheduler. Each `{_target_: package.module.Class, key: value}`
becomes `Class(*positional, **offered, **keys)`; `offered` holds what the toolkit gives a
constructor that asks for it by parameter name. Keys the class does not take are refused with
one line naming those it does take.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from trainers.task import TaskError

TARGET_KEY = "_target_"


def target_class(target: str, key: str) -> type:
    """The class `target` (package.module.Class) names; `key` is the config key, for errors."""
    module_name, _, name = target.rpartition(".")
    if not module_name or not name.isidentifier():
        raise TaskError(f"{key}._target_={target!r}: give the class as package.module.Class")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise TaskError(f"{key}._target_={target}: no module {err.name!r} on the ranks' import path") from None
    found = getattr(module, name, None)
    if not inspect.isclass(found):
        raise TaskError(f"{key}._target_={target}: {module_name} defines no class {name}")
    return found


def instantiate(spec: Mapping[str, Any], key: str, positional: tuple[Any, ...] = (), offered: Mapping[str, Any] | None = None, base: type | None = None) -> Any:
    """`spec`'s class (a subclass of `base`, when given) called with `positional`, the `offered`
    values its constructor names, and every other key of `spec`."""
    target = str(spec[TARGET_KEY])
    cls = target_class(target, key)
    if base is not None and not issubclass(cls, base):
        raise TaskError(f"{key}._target_={target} is not a {base.__module__}.{base.__qualname__}")
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    given = {name: value for name, value in spec.items() if name != TARGET_KEY}
    unknown = sorted(name for name in given if name not in params and not takes_any)
    if unknown:
        skipped = set(list(params)[: len(positional)]) | set(offered or {})
        takes = ", ".join(name for name, p in params.items() if name not in skipped and p.kind is not inspect.Parameter.VAR_POSITIONAL) or "nothing"
        raise TaskError(f"{key}.{unknown[0]}: {target} takes no argument {unknown[0]!r}; it takes: {takes}")
    chosen = {name: value for name, value in (offered or {}).items() if name in params and name not in given}
    try:
        return cls(*positional, **chosen, **given)
    except TypeError as err:  # a required argument the config does not give, or a wrong type
        raise TaskError(f"{key}._target_={target}: {err}") from None
