"""The argument parser of the toolkit's commands (`python -m hpc.status`, `hpc.report`, ...).

argparse, with `--help` as usual, but a usage error is one line and exit 2 like every other
user error here (argparse's own error prints the whole usage block first). Stdlib only: the
commands that use it start on a login node.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    def __init__(self, prog: str, description: str, **kwargs: object) -> None:
        # Raw: the descriptions are the modules' docstrings, laid out by hand
        super().__init__(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
