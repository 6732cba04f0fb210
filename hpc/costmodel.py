"""`python -m hpc.costmodel`: the public command name; the code is hpc/tools/costmodel.py."""

import sys

from hpc.tools.costmodel import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
