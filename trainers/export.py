"""`python -m trainers.export`: the command's public name; the code is trainers/checkpoint/export.py."""

import sys

from trainers.checkpoint.export import main

if __name__ == "__main__":
    sys.exit(main())
