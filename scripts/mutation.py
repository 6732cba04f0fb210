"""Mutation testing of the modules whose guarantees the README states (issue 46): each small
change to their code (a comparison turned, `and` for `or`, a constant moved by one, a call left
out, a returned value dropped) must fail one of their fast tests. A mutant no test fails is a
guarantee nothing guards, or an equivalent change (EQUIVALENT says why, one by one).

    python3 scripts/mutation.py [--module trainers.checkpoint.state ...] [--json OUT] [--timeout-s 120]

How: a copy of the checkout's tracked files (the checkout itself is never written); one pass of
each module's tests under a line tracer finds which tests run which statement; then each mutant
is written into the copy and only the tests that run its statement run, in a process forked from
one that imported torch once (about a second a mutant, not the five of a fresh interpreter), and
stop at the first failure. Nothing is compiled to bytecode: a mutant of the same size written in
the same second would otherwise be read back from a stale .pyc. Prints one line per module
(killed / all, survivors listed) and, with --json, writes every mutant's fate.

Not mutated, by rule: docstrings and other strings (messages; the tests that read them are
slow-tier ones), logging calls, type annotations, `if TYPE_CHECKING:` blocks.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import copy
import importlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The modules of issue 46's list and the unit tests that state their guarantees.
TARGETS: dict[str, list[str]] = {
    "hpc.rank.failures": ["tests/unit/test_rank_failures.py"],
    "trainers.reporting.metricnames": [
        "tests/unit/test_metricnames.py",
        "tests/unit/test_fit_in_process.py",
        "tests/unit/test_run_handle.py",
        "tests/unit/test_task_seam.py",
    ],
    "trainers.boundary": [
        "tests/unit/test_boundary.py",
        "tests/unit/test_host_overhead.py",
        "tests/unit/test_fit_in_process.py",
        "tests/unit/test_stop_phases.py",
        "tests/unit/test_checkpoint_options.py",
        "tests/unit/test_training_features.py",
    ],
    "trainers.checkpoint.state": [
        "tests/unit/test_state.py",
        "tests/unit/test_checkpoint.py",
        "tests/unit/test_fit_in_process.py",
        "tests/unit/test_run_handle.py",
        "tests/unit/test_stop_phases.py",
        "tests/unit/test_sharded_features.py",
        "tests/unit/test_training_features.py",
    ],
    "trainers.rngstreams": ["tests/unit/test_rng_streams.py", "tests/unit/test_checkpoint.py"],
    "trainers.checkpoint.checkpointer": [
        "tests/unit/test_checkpoint.py",
        "tests/unit/test_checkpoint_store.py",
        "tests/unit/test_checkpoint_options.py",
        "tests/unit/test_saving.py",
        "tests/unit/test_unwritable.py",
    ],
    "trainers.checkpoint.export": ["tests/unit/test_export.py", "tests/unit/test_checkpoint_store.py"],
    "trainers.reporting.trackers": ["tests/unit/test_trackers.py"],
    "trainers.reporting.sinks": ["tests/unit/test_reporting.py", "tests/unit/test_task_seam.py", "tests/unit/test_trackers.py"],
    "trainers.checkpoint.storage": [
        "tests/unit/test_storage.py",
        "tests/unit/test_checkpoint_store.py",
        "tests/unit/test_checkpoint.py",
        "tests/unit/test_spec.py",
    ],
    "hpc.config.search": ["tests/unit/test_search.py", "tests/unit/test_search_checks.py"],
    "hpc.config.validate": [
        "tests/unit/test_validate_bounds.py",
        "tests/unit/test_training_features.py",
        "tests/unit/test_sbatch_options.py",
        "tests/unit/test_backend_table.py",
        "tests/unit/test_first_hour.py",
        "tests/unit/test_backends_preflight.py",
        "tests/unit/test_spec.py",
        "tests/unit/test_fuzz.py",
        "tests/unit/test_launchers.py",
    ],
    # Each section's own checks, moved out of hpc.config.validate (issue 47): the trainer's sections
    "trainers.config": ["tests/unit/test_section_checks.py", "tests/unit/test_validate_bounds.py", "tests/unit/test_training_features.py"],
    "collectives.backends": [
        "tests/unit/test_section_checks.py",
        "tests/unit/test_backend_table.py",
        "tests/unit/test_backends_preflight.py",
        "tests/unit/test_validate_bounds.py",
    ],
    "hpc.launching.launchers": ["tests/unit/test_launchers.py", "tests/unit/test_search.py", "tests/unit/test_api.py"],
    "hpc.rank.scheduler": ["tests/unit/test_launchers.py", "tests/unit/test_rank_failures.py"],
}

# Survivors that change nothing a user can observe, each with its reason: "module:line:change".
SAME_DIGEST = "another cut of the same blake2b digest: still two independent 20-bit hashes"
DURABILITY = "durability across a power cut (flush, fsync): not observable short of one"
CUDA_ONLY = "the CUDA streams: nothing to restore without a CUDA device (the device command's resume check compares a GPU run's resume bit for bit)"
DAEMON = "a daemon thread or not: every path the tests take joins it before the interpreter exits"
EQUIVALENT: dict[str, str] = {
    "hpc.config.search:132:42:0 -> 1": "n_trials was checked >= 1 just above: `or 0` is never taken",
    "hpc.config.search:133:38:0 -> 1": "n_jobs was checked >= 1 just above: `or 0` is never taken",
    "hpc.config.search:160:73:True -> False": "compose_jobs returns one job per override list: the lengths are always equal",
    "hpc.config.search:222:24:and -> or": "Hydra's interval() has two float ends, or two int ones under int(): never one of each",
    "trainers.rngstreams:27:47:1 -> 2": "a 62-bit seed instead of 63: as decorrelated, as reproducible",
    "trainers.checkpoint.export:76:8:call left out": "durability across a power cut (flush before fsync): not observable short of one",
    "trainers.checkpoint.export:77:8:call left out": "durability across a power cut (fsync before the rename): not observable short of one",
    "trainers.checkpoint.export:214:56:True -> False": "the task's description in JSON: key order means nothing to a reader",
    "trainers.checkpoint.export:243:4:call left out": "the command's entry point (`python -m trainers.export`): the docs' command runs it, not a unit test",
    "trainers.boundary:96:31:compare 0: Gt -> GtE": "torch.cat of one part is a copy of that part: the same values",
    "trainers.checkpoint.state:55:7:compare 0: In -> NotIn": CUDA_ONLY,
    "trainers.checkpoint.state:55:7:and -> or": CUDA_ONLY,
    "trainers.checkpoint.state:56:8:call left out": CUDA_ONLY,
    "trainers.reporting.metricnames:32:75:8 -> 9": SAME_DIGEST,
    "trainers.reporting.metricnames:33:43:4 -> 5": SAME_DIGEST,
    "trainers.reporting.metricnames:33:92:4 -> 5": SAME_DIGEST,
    "trainers.reporting.metricnames:82:46:1 -> 2": "one more padding slot: the header stays first, the bytes follow it",
    "trainers.reporting.metricnames:85:15:1 -> 2": "-2 marks 'no names' as -1 does: any negative header reads as none",
    "trainers.reporting.metricnames:88:20:compare 0: Lt -> LtE": "a rank's names encode to at least `[]` (2 bytes): the header is never 0",
    "trainers.reporting.metricnames:88:29:0 -> 1": "a rank's names encode to at least `[]` (2 bytes): the header is never 0",
    "trainers.checkpoint.storage:108:8:call left out": DURABILITY,
    "trainers.checkpoint.storage:150:8:call left out": DURABILITY,
    "trainers.checkpoint.storage:154:12:call left out": DURABILITY,
    "trainers.checkpoint.storage:155:12:call left out": DURABILITY,
    "trainers.checkpoint.storage:157:8:call left out": DURABILITY,
    "trainers.checkpoint.storage:196:12:call left out": DURABILITY,
    "trainers.checkpoint.storage:197:12:call left out": DURABILITY,
    "trainers.checkpoint.storage:199:8:call left out": DURABILITY,
    "trainers.checkpoint.storage:118:32:compare 0: Lt -> LtE": "the committed step's own staging dir is gone by then (renamed, or deleted by its commit)",
    "trainers.checkpoint.storage:119:47:True -> False": "errors ignored while deleting: deletion succeeds here",
    "trainers.checkpoint.storage:179:47:True -> False": "errors ignored while deleting: deletion succeeds here",
    "trainers.checkpoint.storage:185:79:True -> False": "errors ignored while deleting: deletion succeeds here",
    "trainers.checkpoint.storage:190:50:True -> False": "errors ignored while deleting: deletion succeeds here",
    "trainers.checkpoint.storage:298:56:True -> False": "errors ignored while deleting: deletion succeeds here",
    "trainers.checkpoint.storage:347:49:True -> False": "errors ignored while deleting: deletion succeeds here",
    "trainers.checkpoint.storage:354:60:True -> False": "errors ignored while deleting: deletion succeeds here",
    "trainers.checkpoint.storage:341:16:call left out": "the loop below deletes the marker too (first: a cut removal leaves no committed-looking step)",
    "trainers.checkpoint.storage:389:28:1 -> 2": "the text after the first :// is empty or not either way",
    "trainers.checkpoint.storage:224:39:1 -> 2": "a retry or timeout constant: how long a dead store takes to fail, not whether it does",
    "trainers.checkpoint.storage:282:33:True -> False": "the staged file exists: missing_ok or not, it is deleted",
    "trainers.checkpoint.storage:219:67:5 -> 6": "a retry or timeout constant: how long a dead store takes to fail, not whether it does",
    "trainers.checkpoint.storage:239:50:1 -> 2": "a retry or timeout constant: how long a dead store takes to fail, not whether it does",
    "trainers.checkpoint.storage:239:93:10 -> 11": "a retry or timeout constant: how long a dead store takes to fail, not whether it does",
    "trainers.checkpoint.storage:239:113:120 -> 121": "a retry or timeout constant: how long a dead store takes to fail, not whether it does",
    "trainers.checkpoint.storage:250:69:5 -> 6": "a retry or timeout constant: how long a dead store takes to fail, not whether it does",
    "trainers.checkpoint.storage:250:94:0.5 -> 1.5": "a retry or timeout constant: how long a dead store takes to fail, not whether it does",
    "trainers.checkpoint.storage:267:30:1 -> 2": "a retry or timeout constant: how long a dead store takes to fail, not whether it does",
    "trainers.checkpoint.storage:433:58:5 -> 6": "a retry or timeout constant: how long a dead store takes to fail, not whether it does",
    "trainers.checkpoint.storage:445:56:1 -> 2": "a retry or timeout constant: how long a dead store takes to fail, not whether it does",
    "trainers.checkpoint.storage:364:73:compare 0: Lt -> LtE": "the committed step has its marker: never a leftover",
    "trainers.checkpoint.storage:381:32:1 -> 2": "the protocol is the text before the first :// either way",
    "trainers.checkpoint.storage:414:75:8 -> 9": "the digest's length: any keeps two runs' places apart",
    "trainers.checkpoint.storage:424:45:True -> False": "checkpoints/ is made in the run dir, which exists",
    "trainers.checkpoint.storage:426:32:compare 0: NotEq -> Eq": "the pointer's text is the same at every start of a run (its config is the first start's)",
    "trainers.checkpoint.storage:302:12:call left out": "s3fs fills no listing cache on this path (another client's commit is seen without it)",
    "trainers.checkpoint.storage:362:12:call left out": "s3fs fills no listing cache on this path: kept for file systems that cache",
    "trainers.checkpoint.checkpointer:55:41:8 -> 9": "the size of the blocks a file is hashed in: the same digest",
    "trainers.checkpoint.checkpointer:55:46:20 -> 21": "the size of the blocks a file is hashed in: the same digest",
    "trainers.checkpoint.checkpointer:65:8:call left out": DURABILITY + " (the file's close flushes it)",
    "trainers.checkpoint.checkpointer:66:8:call left out": DURABILITY,
    "trainers.checkpoint.checkpointer:103:12:call left out": "waits for CUDA copies: no device here (the device suite's resume check has one)",
    "trainers.checkpoint.checkpointer:123:18:True -> False": "nothing assigns to a Committed: frozen or not, the same",
    "trainers.checkpoint.checkpointer:194:37:0 -> 1": "the staging dir of any step: they share one parent",
    "trainers.checkpoint.checkpointer:226:26:True -> False": "the staging root exists (the constructor made it): no parent to make",
    "trainers.checkpoint.checkpointer:249:91:True -> False": DAEMON,
    "trainers.checkpoint.checkpointer:293:62:1 -> 2": "the marker's JSON indentation",
    "trainers.checkpoint.checkpointer:313:20:call left out": "a retired step's cache entry: it is never listed again, and a commit of that step sets it anew",
    "trainers.checkpoint.checkpointer:325:88:True -> False": DAEMON,
    "trainers.checkpoint.checkpointer:334:70:1 -> 2": "best.json's JSON indentation",
}

# Imported by the parent once (the modules under test import them): a mutant's process starts
# with them, instead of importing torch._dynamo (2.5 s) and the rest again.
PRELOADED = ("numpy", "pytest", "torch", "torch._dynamo", "torch.distributed", "h5py", "omegaconf", "hydra", "optuna", "yaml", "hypothesis")

LOGGERS = {"log", "logger", "logging", "warnings"}
COMPARE_SWAP: dict[type, type] = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
BINOP_SWAP: dict[type, type] = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv}


@dataclass
class Mutant:
    module: str
    index: int
    line: int  # of the statement changed
    end_line: int
    where: str  # line:column of the node changed (two alike on one line told apart)
    change: str
    on_import: bool  # module or class level: every test that imports the module runs it
    fate: str = ""  # killed, survived, equivalent, timeout

    @property
    def key(self) -> str:
        return f"{self.module}:{self.where}:{self.change}"


def is_logging_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    while isinstance(func, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Name) and func.id in LOGGERS


class Points(ast.NodeVisitor):
    """The mutation points of a module, in a fixed order: (node, statement, change)."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.AST, ast.stmt, str, bool]] = []  # ..., whether it runs on import
        self.statement: ast.stmt | None = None
        self.in_function = 0

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)  # evaluated on import
        self.in_function += 1
        for statement in node.body:
            self.visit(statement)
        self.in_function -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.stmt):
            self.statement = node
        super().visit(node)

    def generic_visit(self, node: ast.AST) -> None:
        for field, value in ast.iter_fields(node):
            if field in ("annotation", "returns", "type_comment"):
                continue  # types change nothing at run time
            children = value if isinstance(value, list) else [value]
            for child in children:
                if isinstance(child, ast.AST):
                    if isinstance(node, ast.stmt):
                        self.statement = node  # back from a nested statement
                    self.visit(child)

    def add(self, node: ast.AST, change: str) -> None:
        assert self.statement is not None
        self.found.append((node, self.statement, change, self.in_function == 0))

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) or is_logging_call(node.value):
            return  # a docstring; a log line
        if isinstance(node.value, ast.Call):
            self.add(node, "call left out")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if is_logging_call(node):
            return
        self.generic_visit(node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return  # a message

    def visit_Compare(self, node: ast.Compare) -> None:
        for position, op in enumerate(node.ops):
            if type(op) in COMPARE_SWAP:
                self.add(node, f"compare {position}: {type(op).__name__} -> {COMPARE_SWAP[type(op)].__name__}")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        self.add(node, "and -> or" if isinstance(node.op, ast.And) else "or -> and")
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self.add(node, "not dropped")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if type(node.op) in BINOP_SWAP:
            self.add(node, f"{type(node.op).__name__} -> {BINOP_SWAP[type(node.op)].__name__}")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, bool):
            self.add(node, f"{node.value} -> {not node.value}")
        elif isinstance(node.value, int | float) and not isinstance(node.value, bool):
            self.add(node, f"{node.value!r} -> {node.value + 1!r}")

    def visit_Return(self, node: ast.Return) -> None:  # a True or False returned: the constant's own mutant
        if node.value is not None and not (isinstance(node.value, ast.Constant) and (node.value.value is None or isinstance(node.value.value, bool))):
            self.add(node, "returns None")
        self.generic_visit(node)


def mutate(tree: ast.Module, index: int) -> ast.Module:
    """A copy of `tree` with its mutation point `index` changed."""
    changed = copy.deepcopy(tree)
    points = Points()
    points.visit(changed)
    node, _, change, _ = points.found[index]
    if change == "call left out":
        assert isinstance(node, ast.Expr)
        node.value = ast.Constant(None)
    elif change.startswith("compare "):
        assert isinstance(node, ast.Compare)
        position = int(change.split()[1].rstrip(":"))
        node.ops[position] = COMPARE_SWAP[type(node.ops[position])]()
    elif change in ("and -> or", "or -> and"):
        assert isinstance(node, ast.BoolOp)
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif change == "not dropped":
        assert isinstance(node, ast.UnaryOp)
        node.op = ast.UAdd()  # +x: truthiness kept as x's (a bool's +True is 1)
        node.operand = ast.Call(ast.Name("bool", ast.Load()), [node.operand], [])
    elif change == "returns None":
        assert isinstance(node, ast.Return)
        node.value = None
    elif isinstance(node, ast.BinOp):
        node.op = BINOP_SWAP[type(node.op)]()
    elif isinstance(node, ast.Constant):
        node.value = (not node.value) if isinstance(node.value, bool) else node.value + 1
    return ast.fix_missing_locations(changed)


def mutants_of(module: str, tree: ast.Module) -> list[Mutant]:
    points = Points()
    points.visit(tree)
    return [
        Mutant(module, index, stmt.lineno, stmt.end_lineno or stmt.lineno, f"{node.lineno}:{node.col_offset}", change, on_import)  # type: ignore[attr-defined]
        for index, (node, stmt, change, on_import) in enumerate(points.found)
    ]


def forked(run: object, timeout_s: float) -> int:
    """run() in a child process forked from this one (which imported torch once); its exit code
    (124 past the timeout)."""
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            code = run()  # type: ignore[operator]
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return 124
        time.sleep(0.02)  # a child process: nothing to wait on with a timeout but polling


def run_pytest(copy_root: Path, args: list[str], plugins: list[object] | None = None) -> int:
    import pytest

    os.chdir(copy_root)
    sys.path.insert(0, str(copy_root))
    return int(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", *args], plugins=plugins or []))


class LineTracer:
    """A pytest plugin: which lines of `filename` each test ran (setup, call and teardown)."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.lines: dict[str, set[int]] = {}
        self.current: set[int] = set()  # outside a test: thrown away

    def trace(self, frame, event, arg):  # type: ignore[no-untyped-def]
        if frame.f_code.co_filename != self.filename:
            return None

        def local(frame, event, arg):  # type: ignore[no-untyped-def]
            self.current.add(frame.f_lineno)
            return local

        return local(frame, event, arg)

    def pytest_sessionstart(self, session) -> None:  # type: ignore[no-untyped-def]
        import threading

        sys.settrace(self.trace)
        threading.settrace(self.trace)

    def pytest_runtest_logstart(self, nodeid, location) -> None:  # type: ignore[no-untyped-def]
        sys.settrace(self.trace)  # again: code under test (torch's compiler among it) may have set its own
        self.current = self.lines.setdefault(nodeid, set())

    def pytest_runtest_logfinish(self, nodeid, location) -> None:  # type: ignore[no-untyped-def]
        self.current = set()


def coverage(copy_root: Path, module_file: Path, tests: list[str], out: Path, timeout_s: float) -> dict[str, object]:
    """The module's tests once, unmutated, under the line tracer: all must pass."""

    def run() -> int:
        tracer = LineTracer(str(module_file))
        code = run_pytest(copy_root, tests, [tracer])
        out.write_text(json.dumps({"code": code, "tests": {k: sorted(v) for k, v in tracer.lines.items()}}))
        return 0

    forked(run, timeout_s * 10)
    return json.loads(out.read_text())


def covering(mutant: Mutant, lines_by_test: dict[str, list[int]]) -> list[str] | None:
    """The tests that run the mutant's statement; None: all of them (it runs on import)."""
    if mutant.on_import:
        return None
    span = set(range(mutant.line, mutant.end_line + 1))
    return [test for test, lines in lines_by_test.items() if span & set(lines)]


def tracked_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def run_module(module: str, tests: list[str], copy_root: Path, timeout_s: float) -> list[Mutant]:
    module_file = copy_root / (module.replace(".", "/") + ".py")
    source = module_file.read_text()
    tree = ast.parse(source)
    mutants = mutants_of(module, tree)
    seen = coverage(copy_root, module_file, tests, copy_root / ".mutation-coverage.json", timeout_s)
    if seen["code"] != 0:
        raise SystemExit(f"error: {module}'s tests fail unmutated (pytest exit {seen['code']}): {' '.join(tests)}")
    lines_by_test: dict[str, list[int]] = seen["tests"]  # type: ignore[assignment]
    try:
        for mutant in mutants:
            if mutant.key in EQUIVALENT:
                mutant.fate = "equivalent"
                continue
            selected = covering(mutant, lines_by_test) or None  # none traced: a forked loader worker's lines are not, so all run
            module_file.write_text(ast.unparse(mutate(tree, mutant.index)) + "\n")
            code = forked(lambda selected=selected: run_pytest(copy_root, ["-x", *(selected or tests)]), timeout_s)
            mutant.fate = "survived" if code == 0 else "timeout" if code == 124 else "killed"
    finally:
        module_file.write_text(source)
    return mutants


def module_in_a_copy(module: str, timeout_s: float) -> tuple[list[Mutant], float]:
    """run_module in a copy of the checkout of its own (modules mutate side by side)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutation-") as scratch:
        return run_module(module, TARGETS[module], tracked_copy(Path(scratch)), timeout_s), time.monotonic() - started


def summary_line(module: str, mutants: list[Mutant]) -> str:
    fates = [m.fate for m in mutants]
    counted = [f for f in fates if f != "equivalent"]
    killed = sum(f in ("killed", "timeout") for f in counted)
    ratio = killed / len(counted) if counted else 1.0
    left = f"{fates.count('survived')} survived, {fates.count('equivalent')} equivalent"
    return f"{module}: {killed}/{len(counted)} killed ({ratio:.0%}), {left}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", action="append", choices=sorted(TARGETS), help="a module to mutate (default: all of TARGETS)")
    parser.add_argument("--json", type=Path, help="every mutant's fate, as JSON")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="a mutant's tests longer than this: killed (timeout)")
    parser.add_argument("--jobs", type=int, default=1, help="modules mutated side by side (one core each)")
    args = parser.parse_args(argv)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # the tests' own subprocesses too
    sys.dont_write_bytecode = True
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in PRELOADED:  # imported once here: every forked child has them
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    modules = sorted(args.module or TARGETS, key=lambda name: -len((ROOT / (name.replace(".", "/") + ".py")).read_text()))  # the longest first
    results: dict[str, list[Mutant]] = {}
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        running = {pool.submit(module_in_a_copy, module, args.timeout_s): module for module in modules}
        for done in concurrent.futures.as_completed(running):
            module = running[done]
            results[module], seconds = done.result()
            print(f"{summary_line(module, results[module])} [{seconds:.0f} s]", flush=True)
            for mutant in results[module]:
                if mutant.fate == "survived":
                    print(f"  {mutant.fate}: {mutant.key}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({module: [asdict(m) for m in mutants] for module, mutants in results.items()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
