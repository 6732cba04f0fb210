"""Runs documented commands' `--help` in this one process (runpy, as `python -m` and `python
script.py` run them) and prints {command: [exit code, stdout, stderr]} as JSON: one interpreter,
and one import of torch, for every command tests/unit/test_help.py checks.

    python tests/support/help_runner.py -- "-m hpc.status" "benchmarks/checkpoint.py" ...
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys


def answer(command: str, flag: str) -> list[object]:
    words = command.split()
    out, err = io.StringIO(), io.StringIO()
    code: object = 0
    saved = sys.argv[:], sys.path[:]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if words[0] == "-m":
                sys.argv = [words[1], *words[2:], flag]
                sys.path.insert(0, os.getcwd())  # as python -m puts the working directory first
                runpy.run_module(words[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [words[0], *words[1:], flag]
                sys.path.insert(0, words[0].rpartition("/")[0] or ".")  # as python puts a script's dir first
                runpy.run_path(words[0], run_name="__main__")
    except SystemExit as ended:
        code = ended.code if isinstance(ended.code, int) else (0 if ended.code is None else 1)
    except BaseException as error:  # noqa: BLE001 - reported as the command's failure
        code, err = 1, io.StringIO(f"{type(error).__name__}: {error}")
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
    return [code, out.getvalue(), err.getvalue()]


def main(argv: list[str]) -> None:
    commands = argv[argv.index("--") + 1 :]
    print(json.dumps({command: answer(command, "--help") for command in commands}))


if __name__ == "__main__":
    main(sys.argv)
