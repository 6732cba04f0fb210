"""`python -m hpc.status`: the public command name; the code is hpc/tools/status.py."""

import signal
import sys

from hpc.tools.status import main

if __name__ == "__main__":
    # `| head` ends the listing quietly. Here, not in main(): called in a process that goes on
    # (a test, a notebook), the default action would end that process at its next broken socket.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main(sys.argv[1:]))
