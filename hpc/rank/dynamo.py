"""torch._dynamo stood in for until something needs more of it than torch's optimizers do.

Every torch.optim optimizer imports torch._dynamo: its first param group calls
`torch._dynamo.disable(fn)` (through `torch._disable_dynamo`) and each of its steps
`torch._dynamo.graph_break()`. Outside a compile both are no-ops (`graph_break` has an empty body;
a disabled function is called as it is while no compile runs), yet the import costs 1.7-1.9
CPU-s, as much as `import torch` itself (2026-12-03, 2 cores): on the critical path of every
rank's start and of every node's warm process, where the built-in loop on the toolkit's engine
never compiles. `stand_in()` puts a module in its place that answers those two calls as torch's
own would while it is not loaded, and imports the real one at the first use of anything else
(torch.compile, DistributedDataParallel, a framework's checks, a submodule's import): a job that
needs it pays the import then, as before; one that does not never pays it. A function disabled
through the stand-in is disabled for real once the real module is loaded (a compile after the
first step sees torch's own wrapper), so compiled code behaves as without the stand-in.

Standard library only at import (torch is imported by `stand_in` itself, when asked)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

NAME = "torch._dynamo"
_loading = threading.RLock()


class StandIn(types.ModuleType):
    """sys.modules' torch._dynamo until the real one is needed: `graph_break` and `disable` are its
    own; any other public name (or `__path__`: a submodule's import) loads the real module."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name != "__path__":
            raise AttributeError(name)  # introspection (inspect.getmodule's hasattr) must not import it mid-way through another import
        return getattr(real(), name)


def standing_in() -> bool:
    return isinstance(sys.modules.get(NAME), StandIn)


def real() -> types.ModuleType:
    """The real torch._dynamo, imported now if the stand-in holds its place."""
    with _loading:
        if standing_in():
            del sys.modules[NAME]
            sys.modules["torch"].__dict__.pop("_dynamo", None)  # the import sets it again, to the real module
        return importlib.import_module(NAME)  # one that failed here fails again, with its own error


def graph_break(msg: str = "") -> None:
    """torch._dynamo.graph_break: nothing in eager code, which is all there is while it is not loaded."""
    if not standing_in():
        real().graph_break(msg)


def disable(fn: Callable[..., Any] | None = None, recursive: bool = True, *, reason: str | None = None, wrapping: bool = True) -> Any:
    """torch._dynamo.disable: `fn` called as it is while no compile can run (the real module not
    loaded); once it is, the real disable of `fn`, made at its first call then."""
    if fn is None:  # the decorator-factory form: not what torch's optimizers use
        return real().disable(fn, recursive, reason=reason, wrapping=wrapping)
    disabled: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if standing_in():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(real().disable(fn, recursive, reason=reason, wrapping=wrapping))
        return disabled[0](*args, **kwargs)

    return call


def stand_in() -> bool:
    """Put the stand-in in torch._dynamo's place (importing torch); False where the real module
    (or the stand-in) is already there, or the torch here has no torch._dynamo to find."""
    import torch

    if NAME in sys.modules:
        return False
    spec = importlib.util.find_spec(NAME)
    if spec is None:
        return False
    module = StandIn(NAME, "torch._dynamo's stand-in (hpc.rank.dynamo): the real module is imported at the first use it cannot answer")
    module.__spec__, module.__file__ = spec, spec.origin  # what introspection reads, answered without the import
    module.graph_break = graph_break  # type: ignore[attr-defined]
    module.disable = disable  # type: ignore[attr-defined]
    sys.modules[NAME] = module
    torch._dynamo = module  # torch's own lazy __getattr__ would import the real one
    return True
