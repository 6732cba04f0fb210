"""The code blocks of README.md and docs/*.md, and what each one says about how it is checked.

A block's fence may follow a marker comment (blank lines between allowed):
    <!-- run by tests/mpi/test_installed.py -->   a named test runs it, read with marked_blocks()
    <!-- not run here: REASON -->                 a real cluster's command, your own files ...
An unmarked shell block is run by tests/e2e/test_docs_commands.py, launch commands as dry runs;
an unmarked Python block is an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.support.runs import ROOT

SHELL = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(run by (\S+)|not run here: (.+?))\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str  # "bash", "python", "" ...
    body: str
    run_by: str | None  # the test that runs it
    not_run: str | None  # why it is not run here

    @property
    def where(self) -> str:
        shown = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{shown}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.lang in SHELL or (self.lang == "" and self.body.lstrip().startswith("$ "))


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent = opening.group(1)
        end = next(j for j in range(index + 1, len(lines)) if lines[j].strip() == "```")
        body = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end])
        before = next((lines[j] for j in range(index - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        run_by = marker.group(2) if marker else None
        not_run = marker.group(3) if marker else None
        found.append(Block(path, index + 1, opening.group(2), body + "\n", run_by, not_run))
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks(path)]


def marked_blocks(doc: str, test_file: str) -> list[Block]:
    """The blocks of `doc` (a path in the checkout) whose marker says `run by` the test file
    `test_file` (the test's __file__), in order: the docs' own text, which that test runs, never
    a copy of it (tests/unit/test_docs.py checks that every marked test reads its blocks here)."""
    name = str(Path(test_file).resolve().relative_to(ROOT))
    found = [block for block in blocks(ROOT / doc) if block.run_by == name]
    assert found, f"no block of {doc} is marked `run by {name}`"
    return found
