"""The product code's shape (hpc/, trainers/, collectives/; issue 47): every function reads on one
screen, under 60 lines with its docstring (the project's own rule), and no two classes share a
name (a reader, or an import, takes one for the other: the run handle's Handle and a collective's
handle were one such pair). What breaks either is named with its file and line."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 60
PRODUCT = ("hpc", "trainers", "collectives")


def long_functions(root: Path, packages: tuple[str, ...]) -> list[str]:
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                    length = node.end_lineno - node.lineno + 1
                    if length >= LIMIT:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {length} lines")
    return found


def clashing_classes(root: Path, packages: tuple[str, ...]) -> dict[str, list[str]]:
    """Class names defined at module level in more than one place -> where."""
    where = defaultdict(list)
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.parse(path.read_text(), str(path)).body:
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f"{path.relative_to(root)}:{node.lineno}")
    return {name: places for name, places in where.items() if len(places) > 1}


def test_every_function_of_the_product_code_is_under_60_lines():
    assert long_functions(ROOT, PRODUCT) == []


def test_no_two_classes_of_the_product_code_share_a_name():
    assert clashing_classes(ROOT, PRODUCT) == {}


def test_a_long_function_is_named(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(LIMIT))
    (tmp_path / "pkg" / "mod.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}")
    assert long_functions(tmp_path, ("pkg",)) == [f"pkg/mod.py:6 long: {LIMIT + 1} lines"]


def test_a_clashing_class_name_is_named(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("class Handle:\n    pass\n\n\nclass Only:\n    pass\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("def f():\n    class Handle:  # local: not the module's\n        pass\n\n\nclass Handle:\n    pass\n")
    assert clashing_classes(tmp_path, ("pkg",)) == {"Handle": ["pkg/a.py:1", "pkg/sub/b.py:6"]}
