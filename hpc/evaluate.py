"""`python -m hpc.evaluate`: the public command name; the code is hpc/tools/evaluate.py."""

import sys

from hpc.tools.evaluate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
