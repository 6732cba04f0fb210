"""`python -m hpc.topology`: the public command name; the code is hpc/tools/topology.py."""

import sys

from hpc.tools.topology import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
