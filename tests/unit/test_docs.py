"""The docs site builds strictly (no broken link, no page left out of it), and every shell or
Python block in README.md and docs/*.md is run somewhere in CI or says why not
(tests/support/docs.py has the markers)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.docs import Block, all_blocks, blocks
from tests.support.runs import ROOT


def test_the_docs_site_builds_strictly(tmp_path):
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "sweeps" / "index.html").is_file()


def problem(block: Block) -> str | None:
    if block.run_by is not None:
        test = ROOT / block.run_by
        if not test.is_file():
            return f"{block.where}: run by {block.run_by}, which does not exist"
        doc = str(block.path.relative_to(ROOT))
        if f'marked_blocks("{doc}", __file__)' not in test.read_text():
            return f'{block.where}: {block.run_by} never reads it with marked_blocks("{doc}", __file__)'
        if not block.body.strip():
            return f"{block.where}: an empty block"
        return None
    if block.not_run is not None or block.is_shell:
        return None  # not run with its reason, or run by tests/e2e/test_docs_commands.py
    if block.lang == "python":
        return f"{block.where}: a Python block nobody runs: mark it <!-- run by tests/... --> or <!-- not run here: why -->"
    return None


def test_every_code_block_is_run_or_says_why_not():
    found = all_blocks()
    assert sum(block.is_shell for block in found) >= 10 and sum(block.lang == "python" for block in found) >= 4, "the extraction lost blocks"
    problems = [p for p in map(problem, found) if p]
    assert not problems, "\n".join(problems)


def test_the_marker_check_can_fail(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("```python\nprint(1)\n```\n\n<!-- run by tests/nowhere.py -->\n```bash\nls\n```\n\n<!-- not run here: a cluster's -->\n```python\nx\n```\n")
    found = blocks(doc)
    assert [(b.lang, b.run_by, b.not_run) for b in found] == [("python", None, None), ("bash", "tests/nowhere.py", None), ("python", None, "a cluster's")]
    assert "a Python block nobody runs" in str(problem(found[0])) and "does not exist" in str(problem(found[1])) and problem(found[2]) is None
