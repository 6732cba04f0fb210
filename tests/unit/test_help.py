"""Every command the README and the docs pages name answers --help and -h: exit 0, a usage text.

The commands are read from the documents themselves, so a command added there without a parser
that knows --help fails here. One Python answers every command's --help in turn
(tests/support/help_runner.py, through runpy as `python -m` runs a module): a dozen of them import
torch first, which one start per command paid a dozen times. The two that set up their process
(launch.py: Hydra, with its own flags, both -h and --help; the rank's entry point: signal
handlers and faulthandler on the real stderr before anything else) run in processes of their own.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support.runs import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Named in the docs as history, not as commands to run: "(since replaced by ...)"
RETIRED = {"benchmarks/default_job.py"}
# What the extraction must find, so that a change in the docs' wording cannot empty the list unseen
EXPECTED = {
    "-m hpc.status",
    "-m hpc.report",
    "-m hpc.resubmit",
    "-m hpc.costmodel",
    "-m collectives.bench",
    "-m trainers.checkpoint.tensorfile",
    "-m trainers.tokens",
    "-m hpc.topology detect",
    "-m hpc.topology show",
    "-m hpc.topology place",
    "launch.py",
    "benchmarks/training.py overlap",
    "benchmarks/checkpoint.py",
    "benchmarks/rail_fabric.py",
    "benchmarks/reliability.py",
    "benchmarks/lm_throughput.py",
}
# `python -m pkg.mod [subcommand]` or `python script.py [subcommand]`; a subcommand is a bare
# lower-case word (not an override `a=b`, a path, an option or the end of a code span)
COMMAND = re.compile(r"python3? (-m [a-z_]+(?:\.[a-z_]+)+|(?:benchmarks/)?[a-z_]+\.py)(?: ([a-z][a-z_]*)(?=[ \t\n]))?")
# These take a path or a file where the docs write a word; their positional is not a subcommand
OWN_PROCESS = {"launch.py", "-m hpc.rank.main"}
NO_SUBCOMMANDS = {"-m hpc.status", "-m hpc.report", "-m hpc.resubmit", "-m trainers.checkpoint.tensorfile", "launch.py"}


def documented_commands() -> list[str]:
    found: set[str] = set()
    for doc in DOCS:
        for match in COMMAND.finditer(doc.read_text()):
            command, word = match.groups()
            if command in RETIRED:
                continue
            found.add(command if word is None or command in NO_SUBCOMMANDS else f"{command} {word}")
    return sorted(found)


COMMANDS = documented_commands()


def test_the_docs_name_the_commands_checked_here():
    assert EXPECTED <= set(COMMANDS), f"not found in the docs any more: {sorted(EXPECTED - set(COMMANDS))}"
    for command in COMMANDS:
        script = command.split()[0]
        assert script == "-m" or (ROOT / script).is_file(), f"the docs name {script}, which does not exist"
    assert not any((ROOT / retired).exists() for retired in RETIRED), "a retired script is back: drop it from RETIRED"


def _run(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def answers() -> dict[str, list]:
    """Every documented command's --help but OWN_PROCESS's, answered by one process: command -> [exit code, stdout, stderr]."""
    proc = _run("tests/support/help_runner.py", "--", *(c for c in COMMANDS if c not in OWN_PROCESS))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("command", COMMANDS)
def test_every_documented_command_answers_help(command, answers):
    # argparse answers -h with the --help action itself, which its help lists as "-h, --help";
    # Hydra's launch.py has its own flags, so both are run there
    flags = ("--help", "-h") if command == "launch.py" else ("--help",)
    if command in OWN_PROCESS:
        started = [_run(*command.split(), flag) for flag in flags]
        outputs = [proc.communicate(timeout=120) for proc in started]
        results = [(proc.returncode, out, err) for proc, (out, err) in zip(started, outputs, strict=True)]
    else:
        results = [tuple(answers[command])]
    for flag, (returncode, out, err) in zip(flags, results, strict=True):
        assert returncode == 0, f"{command} {flag}: exit {returncode}\n{err[-2000:]}"
        if command == "launch.py":  # Hydra's help, by the README: the config groups, an option a line
            assert "== Config groups" in out and "resources:" in out, out
            continue
        assert out.startswith("usage: "), f"{command} {flag}:\n{out[:500]}"
        usage = out.split("\n\n")[0]
        if command.startswith("-m "):  # a subcommand's own help, not its parent's: the usage begins with both
            assert usage.startswith(f"usage: python {command}"), usage
        else:  # scripts: argparse names them by file; a suite is a positional choice of the same parser
            assert all(word.split("/")[-1] in usage for word in command.split()), usage
        assert "-h, --help" in out, out


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "hpc.status", "runs", "more"],
        ["-m", "hpc.status", "--all"],
        ["-m", "hpc.report"],
        ["-m", "hpc.resubmit"],
        ["-m", "hpc.costmodel", "extra"],
        ["-m", "hpc.topology"],
        ["-m", "hpc.topology", "bogus"],
        ["-m", "hpc.topology", "place", "resources.nodes=2"],
    ],
)
def test_a_wrong_command_line_is_one_line_and_exit_2(args):
    proc = _run(*args)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"python -m {args[1]}") and err.rstrip().endswith("(see --help)"), err


def test_the_commands_still_do_their_work():
    # Overrides and options in any order after the subcommand, as before the sub-parsers
    show = _run("-m", "hpc.topology", "show", "resources.nodes=2", "--hosts", "n[1-2]", "resources.tasks_per_node=1")
    model = _run("-m", "hpc.costmodel")
    out, err = show.communicate(timeout=60)
    assert show.returncode == 0, err
    assert out.splitlines()[0].split()[:4] == ["rank", "node", "local", "host"] and len(out.splitlines()) == 3, out
    out, err = model.communicate(timeout=60)
    assert model.returncode == 0, err
    assert out.startswith("128 nodes x 8 GPUs") and "| 1024 MiB |" in out, out
