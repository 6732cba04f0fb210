"""The import graph, read with Python's ast, keeps the direction the code is laid out by:

    launch.py -> hpc.config -> hpc.launching ⇢ (sbatch/srun/mpirun) -> hpc.rank -> trainers -> collectives

Imports inside functions count (they run); imports under `if TYPE_CHECKING:` do not. A rule
broken here names the importing module, the line and the imported one."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hpc", "collectives", "trainers", "benchmarks", "tests")
LEAVES = {"hpc.errors", "hpc.rundir", "hpc.env", "hpc.schedulers", "hpc.cli", "hpc.interruptions", "hpc.runroots", "hpc.liveness"}
LEAVES |= {"hpc.slurm.environment", "hpc.slurm.slurmctl"}  # the Slurm plugin's: its variables, its tools
# `python -m hpc.status` and friends: public command names (README) forwarding to hpc.tools.
COMMANDS = {f"hpc.{name}": f"hpc.tools.{name}" for name in ("status", "report", "topology", "costmodel", "stop", "resubmit", "evaluate")}
# `python -m trainers.export` and friends: public command names (README, docs) forwarding to the topic packages.
TRAINER_COMMANDS = {"trainers.export": "trainers.checkpoint.export", "trainers.convert": "trainers.data.convert", "trainers.tokens": "trainers.data.tokens"}


@dataclass(frozen=True)
class Import:
    source: str
    target: str  # a module of ours when it resolves to one, else the top-level external name
    line: int
    at_module_level: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    found = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    found["launch"] = ROOT / "launch.py"
    return found


MODULES = our_modules()


def resolve(name: str) -> str:
    """`hpc.config.schema.JobConfig` -> `hpc.config.schema`; an external name -> its top level."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return parts[0]


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def walk_imports(node: ast.AST, module: str, package: str, in_function: bool) -> Iterator[Import]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and is_type_checking(child):
            for branch in child.orelse:  # `else:` of `if TYPE_CHECKING:` runs
                yield from walk_imports(ast.Module(body=[branch], type_ignores=[]), module, package, in_function)
            continue
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield Import(module, resolve(alias.name), child.lineno, not in_function)
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                base = ".".join([*anchor, *([child.module] if child.module else [])])
            for alias in child.names:
                yield Import(module, resolve(f"{base}.{alias.name}"), child.lineno, not in_function)
        else:
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from walk_imports(child, module, package, nested)


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return [i for i in walk_imports(ast.parse(path.read_text()), module, package, False) if i.target != module]


GRAPH = {module: imports_of(module) for module in MODULES}


def under(module: str, *prefixes: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def violations(sources: tuple[str, ...], forbidden: tuple[str, ...], module_level_only: bool = False) -> list[str]:
    return [
        f"{i.source}:{i.line} imports {i.target}"
        for module, found in GRAPH.items()
        if under(module, *sources)
        for i in found
        if under(i.target, *forbidden) and (i.at_module_level or not module_level_only)
    ]


def cycle_in(nodes: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, as a path that ends where it starts; None if none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(nodes.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(nodes):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_graph_sees_function_level_imports_and_skips_type_checking_ones():
    rank_main = {i.target for i in GRAPH["hpc.rank.main"]}
    assert "trainers.loop.fit" in rank_main  # imported inside run_fit only
    assert "collectives.base" not in rank_main  # under `if TYPE_CHECKING:` only


def test_no_module_takes_part_in_an_import_cycle():
    product = ("hpc", "collectives", "trainers")
    edges = {m: {i.target for i in found if under(i.target, *product)} for m, found in GRAPH.items() if under(m, *product)}
    assert cycle_in(edges) is None, " -> ".join(cycle_in(edges) or [])


def test_no_cycle_between_the_parts_of_hpc():
    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for module, found in GRAPH.items():
        if under(module, "hpc") and module not in COMMANDS and module != "hpc":
            edges.setdefault(part(module), set()).update(part(i.target) for i in found if under(i.target, "hpc") and part(i.target) != part(module))
    assert cycle_in(edges) is None, " -> ".join(cycle_in(edges) or [])


def test_leaves_import_nothing_of_hpc_but_other_leaves():
    bad = [f"{i.source}:{i.line} imports {i.target}" for leaf in LEAVES for i in GRAPH[leaf] if under(i.target, "hpc") and i.target not in LEAVES]
    assert not bad, bad


def parents(module: str) -> list[str]:
    """The packages Python imports (their __init__) before `module` itself."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts)) if ".".join(parts[:end]) in MODULES]


def closure(start: str, module_level_only: bool) -> set[str]:
    """Every module (ours and external top-level names) importing `start` may import, parent
    packages' __init__ included: their module-level imports, which importing a submodule runs
    (a function of theirs runs only where a module imports the package itself and calls it)."""
    seen: set[str] = set()
    todo = [(start, module_level_only), *((parent, True) for parent in parents(start))]
    while todo:
        module, level_only = todo.pop()
        for i in GRAPH.get(module, []):
            if (i.at_module_level or not level_only) and i.target not in seen:
                seen.add(i.target)
                todo += [(i.target, module_level_only), *((parent, True) for parent in parents(i.target) if parent not in seen)]
    return seen


def test_the_rank_side_never_imports_submission_code_hydra_or_submitit():
    bad = violations(("hpc.rank",), ("hpc.launching", "hpc.tools", "hpc.config.compose", "hydra", "hydra_plugins", "submitit"))
    assert bad == [], bad
    for module in (m for m in MODULES if under(m, "hpc.rank")):  # nor through what it imports, at any depth
        reached = {m for m in closure(module, module_level_only=False) if under(m, "hpc.launching", "hpc.tools", "hydra", "hydra_plugins", "submitit")}
        assert not reached, f"{module} reaches {sorted(reached)}"


def test_the_ranks_first_statement_catches_the_stop_signals_with_the_standard_library_only():
    """srun and mpirun start `python -m hpc.rank.main`: a stop signal must be caught before torch
    (or anything slow) starts importing."""
    at_start = {i.target for i in GRAPH["hpc.rank.signals"] if i.at_module_level}
    assert all(target.split(".")[0] in sys.stdlib_module_names for target in at_start), sorted(at_start)
    body = ast.parse((ROOT / "hpc" / "rank" / "main.py").read_text()).body
    first = next(node for node in body[1:] if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"))  # after the docstring
    assert isinstance(first, ast.If) and "__main__" in ast.unparse(first.test), ast.unparse(first)
    assert "from hpc.rank.signals import catch_stop_signals" in ast.unparse(first) and "catch_stop_signals()" in ast.unparse(first)


def test_the_submission_side_reaches_the_rank_only_through_its_entry_point():
    submission = ("hpc.launching", "hpc.config", "hpc.app", "launch", *SLURM_LOGIN_SIDE)
    bad = [v for v in violations(submission, ("hpc.rank",)) if not v.endswith(" imports hpc.rank.main")]
    assert not bad, bad


# The Slurm plugin (hpc.schedulers): its login side, and its rank side, which the ranks load by name
SLURM_LOGIN_SIDE = ("hpc.slurm.launcher", "hpc.slurm.batch", "hpc.slurm.prepare", "hpc.slurm.options")
SLURM_RANK_SIDE = ("hpc.slurm.job", "hpc.slurm.environment")


def test_only_the_slurm_plugin_imports_slurm_code():
    """Nothing of the toolkit outside hpc.slurm imports it (the registry names it in strings;
    benchmarks that drive the simulated Slurm may ask slurmctl): a scheduler is one package."""
    bad = [v for v in violations(("hpc", "collectives", "trainers", "launch"), ("hpc.slurm",)) if not v.startswith("hpc.slurm.")]
    assert not bad, bad
    assert {i.target for i in GRAPH["hpc.slurm"]} == set(), "hpc.slurm's __init__ imports nothing: a rank loading its rank side loads no login code"


def test_the_slurm_plugins_rank_side_reaches_no_login_code():
    for module in SLURM_RANK_SIDE:
        login = ("hpc.launching", "hpc.tools", "hpc.config", *SLURM_LOGIN_SIDE, "hydra", "submitit")
        reached = {m for m in closure(module, module_level_only=False) if under(m, *login)}
        assert not reached, f"{module} reaches {sorted(reached)}"


def test_nothing_but_the_process_s_own_start_imports_the_rank_entry_point():
    """The run handle (hpc.run) builds its services where the built-in loop does (hpc.rank.services,
    issue 47); only the submission side names the entry point, to start it."""
    bad = [v for v in violations(("hpc.run", "hpc.rank", "hpc.tools", "trainers", "collectives"), ("hpc.rank.main",)) if not v.startswith("hpc.rank.main")]
    assert not bad, bad


def test_backend_names_are_branched_on_only_in_the_backend_table():
    """comm=gloo/nccl/horovod/mpi rules live in collectives/backends.py (issue 47): nowhere else
    compares a config's backend (`<x>.backend`) to a backend's name."""
    found = []
    for module in (m for m in MODULES if under(m, "hpc", "collectives", "trainers") and m != "collectives.backends"):
        for node in constants(MODULES[module]):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "backend":
                names = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in ("mpi", "gloo", "nccl", "horovod")]
                if names:
                    found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_what_the_batch_step_and_the_ranks_import_first_is_light():
    # submitit pickles hpc.slurm.supervise.supervise_step on the login node by reference and runs
    # it in the batch step: importing it must stay light; so must hpc.rank.main's module level
    heavy = {"torch", "omegaconf", "hydra", "numpy", "h5py", "mpi4py", "submitit"}
    for module in ("hpc.slurm.supervise", "hpc.rank.main"):
        reached = closure(module, module_level_only=True)
        assert not reached & heavy, (module, sorted(reached & heavy))


def test_login_node_commands_do_not_import_torch_at_start():
    starts = ["launch", "hpc.app", "hpc.config.validate", "hpc.launching.launch", "hpc.launching.sweep", *COMMANDS]
    for start in starts:
        reached = closure(start, module_level_only=True)
        assert "torch" not in reached, f"{start} imports torch at module level (through {sorted(m for m in reached if m in MODULES)})"


def test_the_backend_table_and_a_runs_context_stay_below_what_reads_them():
    # The login node reads the backend table (validate, comm=auto): no torch or MPI at its module
    # level. What a run is given (trainers.context) sits below the loop, the fit and the run
    # handle that read it: none of them is imported back.
    reached = closure("collectives.backends", module_level_only=True)
    assert not reached & {"torch", "mpi4py", "numpy"}, sorted(reached & {"torch", "mpi4py", "numpy"})
    bad = violations(("trainers.context",), ("trainers.loop", "trainers.loop.fit", "trainers.handle", "trainers.boundary"))
    assert not bad, bad
    readers = {module for module, found in GRAPH.items() if any(i.target == "hpc.rank.services" for i in found) and not module.startswith("tests.")}
    assert readers <= {"hpc.rank.main", "hpc.run"}, readers


LOOP_PARTS = ("trainers.loop.engine", "trainers.loop.dataplan", "trainers.loop.policies")
LOOP_ABOVE = ("trainers.loop.passes", "trainers.loop.build", "trainers.loop.fit")


def test_the_loops_parts_know_neither_each_other_nor_the_loop():
    # The loop split by job: records below everything; the engine, the data plan and the step
    # policies side by side, each ignorant of the others; the passes above them, the builder
    # above the passes, fit above all. Outside the package only fit is imported (tests aside).
    for part in LOOP_PARTS:
        bad = violations((part,), tuple(p for p in (*LOOP_PARTS, *LOOP_ABOVE) if p != part))
        assert not bad, bad
    assert not violations(("trainers.loop.records",), (*LOOP_PARTS, *LOOP_ABOVE))
    assert not violations(("trainers.loop.passes",), LOOP_ABOVE[1:])
    assert not violations(("trainers.loop.build",), LOOP_ABOVE[2:])
    outside = [v for v in violations(tuple(p for p in PACKAGES if p != "tests"), ("trainers.loop",)) if not v.startswith("trainers.loop.")]
    assert all(v.endswith(" imports trainers.loop.fit") for v in outside), outside


# trainers/ by topic: what a room may not import (the rooms below the loop know nothing of it,
# and none of the others' business: checkpoints are not reported, data is not checkpointed but
# through the store, reporting knows no data or checkpoint, a task no loop or checkpoint).
ROOMS_MAY_NOT_IMPORT = {
    "trainers.checkpoint": ("trainers.data", "trainers.reporting", "trainers.loop", "trainers.tasks"),
    "trainers.data": ("trainers.checkpoint.checkpointer", "trainers.checkpoint.state", "trainers.reporting", "trainers.loop", "trainers.tasks"),
    "trainers.reporting": ("trainers.checkpoint", "trainers.data", "trainers.loop", "trainers.tasks"),
    "trainers.tasks": ("trainers.checkpoint", "trainers.reporting", "trainers.loop"),
}


def test_the_trainers_topic_rooms_import_only_downward():
    for room, forbidden in ROOMS_MAY_NOT_IMPORT.items():
        bad = violations((room,), forbidden)
        assert not bad, bad


def test_trainer_command_names_forward_to_their_room_and_nothing_imports_them():
    for name, target in TRAINER_COMMANDS.items():
        assert {i.target for i in GRAPH[name] if under(i.target, "trainers")} == {target}, f"{name} is a command name and forwards to {target} only"
        readers = sorted(module for module, found in GRAPH.items() if any(i.target == name for i in found))
        assert readers == [], f"{name} is a command name; import {target} instead ({readers})"


def test_nothing_imports_the_user_tools_but_their_command_names():
    bad = [v for v in violations(tuple(p for p in PACKAGES if p != "tests"), ("hpc.tools",)) if not v.startswith("hpc.tools.")]
    bad = [v for v in bad if not any(v.startswith(f"{name}:") and v.endswith(f" imports {target}") for name, target in COMMANDS.items())]
    assert not bad, bad
    for name, target in COMMANDS.items():
        assert {i.target for i in GRAPH[name] if under(i.target, "hpc")} == {target}, f"{name} is a command name and forwards to {target} only"


def test_collectives_import_neither_hpc_nor_trainers():
    bad = violations(("collectives",), ("hpc", "trainers"))
    assert not bad, bad


def test_trainers_import_neither_hpc_nor_hydra_nor_submitit():
    bad = violations(("trainers",), ("hpc", "hydra", "hydra_plugins", "submitit"))
    assert not bad, bad


def test_the_fabric_library_is_pure():
    bad = violations(("hpc.fabric",), ("hpc.config", "hpc.launching", "hpc.rank", "hpc.tools", "hpc.slurm", "torch", "hydra", "subprocess", "submitit"))
    assert not bad, bad


def test_config_imports_no_submission_rank_or_tool_code():
    bad = violations(("hpc.config",), ("hpc.launching", "hpc.rank", "hpc.tools"))
    assert not bad, bad


PRODUCT = ("hpc", "collectives", "trainers", "benchmarks", "launch")


def constants(path: Path) -> Iterator[ast.AST]:
    return ast.walk(ast.parse(path.read_text()))


def builds_command(path: Path, first: set[str], anywhere: set[str] = frozenset()) -> bool:  # type: ignore[assignment]
    """A command line (a list or tuple literal) starting with one of `first`, or holding one of `anywhere`."""
    for node in constants(path):
        if isinstance(node, ast.List | ast.Tuple) and node.elts:
            words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            head = node.elts[0]
            if (isinstance(head, ast.Constant) and head.value in first) or set(words) & anywhere:
                return True
    return False


def test_only_slurmctl_runs_slurms_tools():
    tools = {"scontrol", "squeue", "sacct", "sinfo", "scancel", "sbatch"}
    users = sorted(m for m in MODULES if under(m, *PRODUCT) and builds_command(MODULES[m], tools))
    assert users == ["hpc.slurm.slurmctl"], users


def test_one_builder_of_the_mpirun_command():
    # rail_fabric starts its ranks on emulated hosts inside a network namespace: a launcher of its own
    users = sorted(m for m in MODULES if under(m, *PRODUCT, "tests") and builds_command(MODULES[m], {"mpirun", "mpiexec"}, {"--map-by", "--bind-to"}))
    assert users == ["benchmarks.rail_fabric", "collectives.mpirun"], users


def reads_variables(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    """Environment variables with these prefixes that the code reads: env["X"], env.get("X"), "X" in env."""
    found = []
    for node in constants(path):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "getenv") and node.args:
            key = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.ops[0], ast.In | ast.NotIn):
            key = node.left.value
        if isinstance(key, str) and key.startswith(prefixes):
            found.append(key)
    return found


def test_one_reader_of_the_launcher_environment():
    # the allreduce benchmark decides whether it was started as one of several ranks before MPI starts
    launcher = ("SLURM_", "OMPI_COMM_WORLD_", "PMIX_", "PMI_")  # where a rank sits (OMPI_MCA_* are settings)
    # a scheduler's own variables are its plugin's environment's (hpc.env asks it): Slurm's here
    allowed = {"hpc.env": launcher[1:], "hpc.slurm.environment": launcher[:1], "collectives.bench": launcher[1:]}
    for module in (m for m in MODULES if under(m, *PRODUCT)):
        read = [key for key in reads_variables(MODULES[module], launcher) if not key.startswith(allowed.get(module, ()))]
        assert not read, f"{module} reads {read}; read the launcher environment through hpc.env"


def test_the_run_dirs_figure_files_have_one_writer_the_run_files_sink():
    """Metrics reach the run dir through the sink protocol only: nothing but the sinks module
    makes the JSON-lines writer (the loop, the handle and the adapters hand records to the
    reporter)."""
    home = {"trainers.reporting.metrics", "trainers.reporting.sinks"}
    for module in (m for m in MODULES if under(m, *PRODUCT) and m not in home):
        named = [node.lineno for node in ast.walk(ast.parse(MODULES[module].read_text())) if isinstance(node, ast.Name) and node.id == "MetricsWriter"]
        assert not named, f"{module} writes metrics itself (lines {named}); hand the record to the reporter (StepReporter.report / .moment)"


def test_the_checkpoint_layout_is_named_in_one_place():
    names = {"COMMITTED", "shared.ckpt"}
    for module in (m for m in MODULES if under(m, *PRODUCT) and m != "trainers.checkpoint.layout"):
        used = [
            n.value
            for n in constants(MODULES[module])
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and (n.value in names or n.value.startswith(("step-", "rank-")) and ".ckpt" in n.value)
        ]
        assert not used, f"{module} spells the checkpoint layout ({used}); use trainers.checkpoint.layout"


@pytest.mark.parametrize("package", ["benchmarks", "hpc", "collectives", "trainers"])
def test_nothing_outside_tests_imports_tests(package):
    bad = violations((package,), ("tests",))
    assert not bad, bad


def test_the_library_runs_no_test_double():
    """collectives.testing (ranks as threads) is for tests, the toolkit's and users': no product
    module uses it."""
    bad = violations(("hpc", "collectives", "trainers", "benchmarks", "launch"), ("collectives.testing",))
    assert not bad, bad


def test_a_broken_rule_is_caught(monkeypatch, tmp_path):
    spelled = tmp_path / "spelled.py"
    spelled.write_text('import os\nos.environ.get("SLURM_JOB_ID")\nrun(["mpirun", "-n", "2"])\nrun(("squeue", "-h"))\n')
    assert reads_variables(spelled, ("SLURM_",)) == ["SLURM_JOB_ID"]
    assert builds_command(spelled, {"mpirun"}) and builds_command(spelled, {"squeue"})
    # the checks above must be able to fail: add an edge that closes a cycle and one the rank may not have
    planted = Import("hpc.rank.main", "hpc.launching.launch", 1, True)
    monkeypatch.setitem(GRAPH, "hpc.rank.main", [*GRAPH["hpc.rank.main"], planted])
    assert violations(("hpc.rank",), ("hpc.launching",)) == ["hpc.rank.main:1 imports hpc.launching.launch"]
    edges = {m: {i.target for i in found if under(i.target, "hpc")} for m, found in GRAPH.items() if under(m, "hpc")}
    assert cycle_in(edges) is not None
    # a parent package's function imports count where a module imports the package itself: a rank
    # module's `from hpc import submit` reaches the launching code that hpc.submit() loads
    monkeypatch.setitem(GRAPH, "hpc.rank.signals", [*GRAPH["hpc.rank.signals"], Import("hpc.rank.signals", "hpc", 1, True)])
    assert under_launching(closure("hpc.rank.signals", module_level_only=False))
    assert not under_launching(closure("hpc.rank.diskfaults", module_level_only=False))  # importing hpc.rank.x runs hpc's module level only


def under_launching(modules: set[str]) -> bool:
    return any(under(module, "hpc.launching") for module in modules)


# --- other projects through their public doors only (issue 33) ------------------------------

EXTERNAL = ("hydra", "submitit", "optuna", "omegaconf", "hydra_plugins")


def private_uses(path: Path) -> list[str]:
    """Imports of a module or name starting with `_` from another project, and `_` attributes
    read off a name imported from one (`JobEnvironment._handle_signals`)."""
    tree = ast.parse(path.read_text())
    external_names: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in EXTERNAL:
            external_names.update(a.asname or a.name for a in node.names)
            if any(part.startswith("_") for part in node.module.split(".")) or any(a.name.startswith("_") for a in node.names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in EXTERNAL:
                    external_names.add((alias.asname or alias.name).split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in external_names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def our_python_files() -> list[Path]:
    return [ROOT / "launch.py", *(p for top in (*PACKAGES, "examples") for p in sorted((ROOT / top).rglob("*.py")))]


def test_no_module_reaches_into_hydra_submitit_or_optuna_internals():
    found = [use for path in our_python_files() for use in private_uses(path)]
    assert not found, "use the public API (or write the piece ourselves):\n" + "\n".join(found)


def test_the_private_use_check_can_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from hydra._internal.utils import get_args_parser\nfrom submitit.core import job_environment\njob_environment.JobEnvironment._handle_signals = None\n"
    )
    assert [use.split(": ", 1)[1] for use in private_uses(probe)] == [
        "from hydra._internal.utils import get_args_parser",
        "job_environment.JobEnvironment._handle_signals",
    ]
