"""What the login node reads of a user's class without importing it (no package __init__ runs,
so torch and the user's own imports stay out of the login node): where its module is, whether it
defines the name, what its constructor takes, what its step() needs."""

from __future__ import annotations

import ast
import importlib.machinery
from pathlib import Path


def find_module_file(dotted: str, search: list[str]) -> tuple[Path | None, str]:
    """Where `dotted` (a.b.c) would be imported from, found without importing anything (no
    package __init__ runs, so torch stays out of the login node); (None, the part missing) when not."""
    parts = dotted.split(".")
    spec = importlib.machinery.PathFinder.find_spec(parts[0], search)
    for depth in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return None, ".".join(parts[:depth])
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: depth + 1]), list(spec.submodule_search_locations))
    if spec is None:
        return None, dotted
    return (Path(spec.origin) if spec.origin and spec.origin not in ("namespace", "built-in") else None), ""


def defines(source: str, name: str) -> bool:
    """Whether a module's top level defines, assigns or imports `name`."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign) and name in {t.id for t in ast.walk(node) if isinstance(t, ast.Name)}:
            return True
        if isinstance(node, ast.Import | ast.ImportFrom) and name in {(a.asname or a.name).split(".")[0] for a in node.names}:
            return True
    return False


def constructor_arguments(source: str, name: str) -> list[str] | None:
    """The keyword arguments class `name` of a module's source takes (its own __init__, or a
    dataclass's fields); None when the source cannot tell (**kwargs, an inherited __init__)."""
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and node.name == name):
            continue
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is not None:
            args = init.args
            return None if args.kwarg else [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs][1:]]
        decorated = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in node.decorator_list}
        if "dataclass" in decorated and not node.bases:
            return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        return None
    return None


def class_source(module: str, name: str, search: list[str], hops: int = 3) -> str | None:
    """The source of the module that defines class `name`, following `from .x import name`
    re-exports (torch.optim.LBFGS lives in torch/optim/lbfgs.py) up to `hops` times; None when
    the source cannot tell."""
    try:
        found, missing = find_module_file(module, search)
        if found is None or missing or found.suffix != ".py":
            return None
        source = found.read_text()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ImportError, ValueError):  # the rank's own import names it, if it matters
        return None
    if any(isinstance(node, ast.ClassDef) and node.name == name for node in tree.body):
        return source
    for node in tree.body:
        if hops and isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name and a.name == name for a in node.names):
            package = module if found.name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(max(node.level - 1, 0)):
                package = package.rpartition(".")[0]
            origin = f"{package}.{node.module}" if node.level and node.module else (package if node.level else node.module or "")
            return class_source(origin, name, search, hops - 1) if origin else None
    return None


def required_step_arguments(source: str, name: str) -> list[str]:
    """The arguments class `name`'s own step() cannot do without (LBFGS's closure); [] when it
    defines none or needs none."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            step = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "step"), None)
            if step is None:
                return []
            positional = [*step.args.posonlyargs, *step.args.args][1:]
            required = positional[: len(positional) - len(step.args.defaults)]
            return [a.arg for a in required] + [a.arg for a, d in zip(step.args.kwonlyargs, step.args.kw_defaults, strict=True) if d is None]
    return []
