"""`python -m hpc.prepare`: the name sbatch scripts written before hpc/ was split still call
(a requeued job reruns its spooled script); the code is hpc/submit/prepare.py."""

import sys

from hpc.submit.prepare import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
