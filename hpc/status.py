"""`python -m hpc.status`: the public command name; the code is hpc/tools/status.py."""

import sys

from hpc.tools.status import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
