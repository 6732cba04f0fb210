"""`python -m trainers.convert`: the command's public name; the code is trainers/data/convert.py."""

import sys

from trainers.data.convert import main

if __name__ == "__main__":
    sys.exit(main())
