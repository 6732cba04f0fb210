"""scripts/mutation.py's mutants (issue 46's mutation pass): each operator changes what it names
and nothing else; what is not mutated by rule (docstrings, log lines, annotations) stays."""

from __future__ import annotations

import ast
import importlib.util
import sys

from tests.support.runs import ROOT

SOURCE = '''
"""A docstring."""
import logging

log = logging.getLogger(__name__)
LIMIT = 3


def decide(a: int, b: list[int], flag: bool = True) -> bool:
    """Its docstring."""
    log.info("deciding %d", a)
    b.append(a)
    if a < LIMIT and not flag:
        return a + 1 in b
    return False
'''


def load():
    if "scripts_mutation" in sys.modules:
        return sys.modules["scripts_mutation"]
    spec = importlib.util.spec_from_file_location("scripts_mutation", ROOT / "scripts" / "mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scripts_mutation"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_each_mutant_changes_one_thing_and_the_rules_leave_the_rest():
    mutation = load()
    tree = ast.parse(SOURCE)
    mutants = mutation.mutants_of("m", tree)
    changes = [(m.line, m.change, m.on_import) for m in mutants]
    assert changes == [
        (6, "3 -> 4", True),  # LIMIT: runs on import
        (9, "True -> False", True),  # a default: evaluated on import
        (12, "call left out", False),  # b.append(a); the log line is not a mutant
        (13, "and -> or", False),
        (13, "compare 0: Lt -> LtE", False),
        (13, "not dropped", False),
        (14, "returns None", False),
        (14, "compare 0: In -> NotIn", False),
        (14, "Add -> Sub", False),
        (14, "1 -> 2", False),
        (15, "False -> True", False),  # `return False`: the constant's mutant, not "returns None"
    ]
    original = ast.unparse(tree)
    texts = [ast.unparse(mutation.mutate(tree, m.index)) for m in mutants]
    assert all(text != original for text in texts) and len(set(texts)) == len(texts)
    assert ast.unparse(tree) == original  # the tree itself is never changed
    namespace: dict = {}
    exec(compile(texts[3], "m", "exec"), namespace)  # and -> or: decide(1, [], True) now passes the test
    assert namespace["decide"](1, [], True) is False and namespace["decide"](1, [2], True) is True


def test_a_mutant_runs_only_the_tests_that_run_its_statement_or_all_on_import():
    mutation = load()
    lines = {"t::a": [12, 13], "t::b": [15]}
    inside = mutation.Mutant("m", 0, 13, 14, "13:7", "and -> or", False)
    assert mutation.covering(inside, lines) == ["t::a"]
    assert mutation.covering(mutation.Mutant("m", 1, 20, 20, "20:4", "1 -> 2", False), lines) == []  # no test runs it
    assert mutation.covering(mutation.Mutant("m", 2, 6, 6, "6:8", "3 -> 4", True), lines) is None  # every test
