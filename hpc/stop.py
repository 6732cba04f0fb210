"""`python -m hpc.stop RUN_DIR`: the public command name; the code is hpc/tools/stop.py."""

import sys

from hpc.tools.stop import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
