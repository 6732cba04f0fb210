"""Every unmarked shell block of README.md and docs/*.md runs, as a bash script in a fresh
directory (tests/support/docs.py has the markers for the others).

`hpc-launch` and `python launch.py` are this checkout's launch.py, and they run as dry runs
(`dry_run=true` added where the command prints nothing anyway: --help, --cfg, --info need none):
the command is composed, checked and, on the simulated cluster, turned into its exact sbatch
script, but nothing trains. A command whose comment starts with `# error:` must fail with exit
code 2 and one line starting with that text (up to a closing `...`)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.support.docs import Block, all_blocks
from tests.support.runs import ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

PRELUDE = f"""set -euo pipefail
hpc-launch() {{
    local arg extra=(dry_run=true)
    for arg in "$@"; do
        case "$arg" in --help | -h | --hydra-help | --version | --cfg | -c | --info | -i | dry_run=*) extra=() ;; esac
    done
    {shlex.quote(sys.executable)} {shlex.quote(str(ROOT / "launch.py"))} "$@" "${{extra[@]}}"
}}
python() {{
    if [[ "${{1:-}}" == launch.py ]]; then shift; hpc-launch "$@"; else {shlex.quote(sys.executable)} "$@"; fi
}}
expect_error() {{  # expect_error 'error: text' command...: exit 2, one line, starting so
    local want=$1 out code=0
    shift
    out=$("$@" 2>&1 >/dev/null) || code=$?
    [[ $code == 2 && $(wc -l <<<"$out") == 1 && "$out" == "$want"* ]] || {{ echo "expected exit 2 and '$want...', got $code: $out" >&2; return 1; }}
}}
"""
ERROR_COMMENT = re.compile(r"^(?P<command>[^#]*?)\s+# (?P<error>error: .*?)(?:\s*\.\.\.)?\s*$")


def script(block: Block) -> str:
    lines = []
    for line in block.body.replace("\\\n", " ").splitlines():
        failing = ERROR_COMMENT.match(line)
        if failing:
            line = f"expect_error {shlex.quote(failing['error'])} {failing['command']}"
        lines.append(line)
    return PRELUDE + "\n".join(lines) + "\n"


RUN_HERE = [block for block in all_blocks() if block.is_shell and block.run_by is None and block.not_run is None]


def test_the_docs_have_blocks_that_run_here():
    assert len(RUN_HERE) >= 5, [b.where for b in RUN_HERE]


@pytest.mark.parametrize("block", RUN_HERE, ids=[b.where for b in RUN_HERE])
def test_a_docs_command_block_runs_as_written(block: Block, tmp_path):
    done = subprocess.run(["bash", "-c", script(block)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block.where}\n{block.body}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("result.json")), "a dry run trained"


def test_the_runner_can_fail(tmp_path):
    def runs(body: str) -> bool:
        block = Block(tmp_path / "page.md", 1, "bash", body, None, None)
        return subprocess.run(["bash", "-c", script(block)], cwd=tmp_path, capture_output=True, text=True, timeout=120).returncode == 0

    assert runs("hpc-launch optim.lrr=0.1  # error: unknown key 'optim.lrr'; valid keys in 'optim': ...\n")
    assert not runs("hpc-launch optim.lrr=0.1  # error: another message\n")
    assert not runs("python launch.py model=nope\n")
    assert not runs("hpc-launch --cfg job\nfalse\n")
