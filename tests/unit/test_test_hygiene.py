"""The tests themselves, read with ast: every test checks something, every pytest.raises names the
message it expects, test modules are never imported, and nothing outside tests/ imports tests.

Failures list file:line so the offending test is one click away.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
ASSERTING_CALLS = {"raises", "warns", "fail", "deprecated_call"}  # pytest's own
HELPER_PREFIXES = ("check_", "assert_")
TEST_MODULE_PACKAGES = ("tests.unit", "tests.mpi", "tests.e2e", "tests.net")


def python_files(root: Path) -> list[Path]:
    """Sources under root; hidden folders (.git, a .venv) and caches are not ours to check."""
    skipped = {"__pycache__", "site-packages", "node_modules"}
    return sorted(p for p in root.rglob("*.py") if not any(part.startswith(".") or part in skipped for part in p.relative_to(root).parts[:-1]))


def outside_tests() -> list[Path]:
    skip = {"tests", "hpc_toolkit.egg-info", ".git", "build", "dist"}
    return [p for p in python_files(ROOT) if not skip & set(p.relative_to(ROOT).parts)]


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"


def called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def is_pytest_raises(call: ast.Call, raises_names: set[str]) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr == "raises" and isinstance(func.value, ast.Name) and func.value.id == "pytest"
    return isinstance(func, ast.Name) and func.id in raises_names


def find_test_functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            yield node


def own_helpers(tree: ast.Module) -> set[str]:
    """check_*/assert_* helpers the tests wrote themselves: defined in the module or imported
    from tests.*. A product function called check_* (hpc.config.validate.check_resources) is not one."""
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
            names |= {alias.asname or alias.name for alias in node.names}
    return {name for name in names if name.startswith(HELPER_PREFIXES)}


def checks_something(test: ast.AST, helpers: set[str]) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call) and (called_name(node) in ASSERTING_CALLS or called_name(node) in helpers):
            return True
    return False


def unchecked_tests(path: Path) -> list[str]:
    tree = parse(path)
    helpers = own_helpers(tree)
    return [f"{where(path, t)} {t.name}" for t in find_test_functions(tree) if not checks_something(t, helpers)]


def exit_code_asserted(function: ast.AST, name: str) -> bool:
    """`with pytest.raises(SystemExit) as name:` followed by an assert on name.value.code."""
    for node in ast.walk(function):
        if isinstance(node, ast.Assert):
            for sub in ast.walk(node.test):
                if (
                    isinstance(sub, ast.Attribute)
                    and sub.attr == "code"
                    and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr == "value"
                    and isinstance(sub.value.value, ast.Name)
                    and sub.value.value.id == name
                ):
                    return True
    return False


def raises_without_match(path: Path) -> list[str]:
    tree = parse(path)
    raises_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "pytest" for a in n.names if a.name == "raises"}
    allowed: set[int] = set()  # ids of SystemExit calls whose exit code is asserted
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for with_node in (n for n in ast.walk(function) if isinstance(n, ast.With | ast.AsyncWith)):
            for item in with_node.items:
                call, var = item.context_expr, item.optional_vars
                if (
                    isinstance(call, ast.Call)
                    and is_pytest_raises(call, raises_names)
                    and call.args
                    and isinstance(call.args[0], ast.Name)
                    and call.args[0].id == "SystemExit"
                    and isinstance(var, ast.Name)
                    and exit_code_asserted(function, var.id)
                ):
                    allowed.add(id(call))
    return [
        where(path, node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and is_pytest_raises(node, raises_names) and id(node) not in allowed and not any(k.arg == "match" for k in node.keywords)
    ]


def imported_modules(tree: ast.Module, path: Path) -> Iterator[tuple[ast.AST, str]]:
    """Every module an import names, relative imports resolved, `from a import b` as a.b too."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            yield node, base
            for alias in node.names:
                yield node, f"{base}.{alias.name}"


def is_test_module(module: str) -> bool:
    package, _, leaf = module.rpartition(".")
    return package in TEST_MODULE_PACKAGES and leaf.startswith("test_")


# --- the rules, over the repository as it is --------------------------------------------------


def test_every_test_function_checks_something():
    offenders = [line for path in python_files(TESTS) if path.name.startswith("test_") for line in unchecked_tests(path)]
    assert offenders == [], "tests with no assert, pytest.raises/warns/fail or check_*/assert_* helper:\n" + "\n".join(offenders)


def test_every_pytest_raises_names_its_message():
    offenders = [line for path in python_files(TESTS) for line in raises_without_match(path)]
    assert offenders == [], "pytest.raises without match= (SystemExit only with its exit code asserted):\n" + "\n".join(offenders)


def test_no_module_imports_a_test_module():
    offenders = sorted(
        {
            f"{where(path, node)} imports {module}"
            for path in python_files(ROOT)
            for node, module in imported_modules(parse(path), path)
            if is_test_module(module)
        }
    )
    assert offenders == [], "test modules are imported (move shared code to tests/support or conftest.py):\n" + "\n".join(offenders)


def test_nothing_outside_tests_imports_tests():
    found: dict[str, str] = {}  # one line per import statement: the module it names first
    for path in outside_tests():
        for node, module in imported_modules(parse(path), path):
            if module.split(".")[0] == "tests":
                found.setdefault(where(path, node), module)
    offenders = [f"{line} imports {module}" for line, module in sorted(found.items())]
    assert offenders == [], "benchmarks/ and product code must not import tests:\n" + "\n".join(offenders)


# --- the scanner itself: each rule catches what it is meant to -----------------------------------


SAMPLE = """
import pytest
from pytest import raises
from hpc.config.validate import check_resources
from tests.support.runs import assert_done

def check_local(x):
    assert x

def test_asserts():
    assert 1 + 1 == 2

def test_product_check_only():
    check_resources(None)

def test_local_helper():
    check_local(1)

def test_imported_helper():
    assert_done(1)

def test_raises_matched():
    with pytest.raises(ValueError, match="bad"):
        int("x")

def test_raises_bare():
    with raises(ValueError):
        int("x")

def test_exit_code_kept():
    with pytest.raises(SystemExit) as info:
        raise SystemExit(2)
    assert info.value.code == 2

def test_exit_code_dropped():
    with pytest.raises(SystemExit):
        raise SystemExit(2)

def test_nothing():
    int("1")
"""


@pytest.fixture
def sample(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    path = tmp_path / "tests" / "unit" / "test_sample.py"
    path.parent.mkdir(parents=True)
    path.write_text(SAMPLE)
    return path


def test_the_scanner_finds_tests_that_check_nothing(sample):
    found = [line.split()[-1] for line in unchecked_tests(sample)]
    assert found == ["test_product_check_only", "test_nothing"]


def test_the_scanner_finds_raises_without_match(sample):
    lines = SAMPLE.splitlines()
    found = [int(line.rsplit(":", 1)[1]) for line in raises_without_match(sample)]
    assert sorted(lines[n - 1].strip() for n in found) == ["with pytest.raises(SystemExit):", "with raises(ValueError):"]


@pytest.mark.parametrize(
    ("source", "where_from", "module"),
    [
        ("import tests.unit.test_cli", "benchmarks/x.py", "tests.unit.test_cli"),
        ("from tests.mpi.test_resume import run", "tests/mpi/test_other.py", "tests.mpi.test_resume"),
        ("from tests.e2e import test_slurm", "tests/support/runs.py", "tests.e2e.test_slurm"),
        ("from .test_backends import job", "tests/unit/test_x.py", "tests.unit.test_backends"),
    ],
)
def test_the_scanner_finds_imports_of_test_modules(tmp_path, monkeypatch, source, where_from, module):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    path = tmp_path / where_from
    found = [name for _, name in imported_modules(ast.parse(source), path) if is_test_module(name)]
    assert found == [module]


def test_the_scanner_allows_support_imports_inside_tests_only(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    modules = [name for _, name in imported_modules(ast.parse("from tests.support.runs import ROOT"), tmp_path / "tests/unit/t.py")]
    assert not any(is_test_module(m) for m in modules) and modules[0].split(".")[0] == "tests"
