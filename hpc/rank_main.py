"""`python -m hpc.rank_main RUN_DIR`: the name sbatch scripts written before hpc/ was split still
call (a requeued job reruns its spooled script); the code is hpc/rank/main.py."""

import sys

from hpc.rank.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
