"""`python -m hpc.report`: the public command name; the code is hpc/tools/report.py."""

import sys

from hpc.tools.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
