"""`python -m trainers.tokens`: the command's public name; the code is trainers/data/tokens.py."""

import sys

from trainers.data.tokens import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
