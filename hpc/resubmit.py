"""`python -m hpc.resubmit`: the public command name; the code is hpc/tools/resubmit.py."""

import sys

from hpc.tools.resubmit import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
