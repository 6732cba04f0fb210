"""The ranks' command under srun: `python -u -m hpc.rank.entry SUBMITIT_FOLDER`.

It catches the stop signals first (hpc.rank.signals), then runs submitit's job runner (load the
pickled call, run it, store its result) without submitit's own signal handlers: those would
ignore SIGTERM and requeue on SIGUSR2 by themselves, behind the training's back. Standard
library only until the job runs.
"""

from __future__ import annotations

import sys

from hpc.rank.signals import catch_stop_signals


def run_submitit_job(folder: str) -> None:
    from submitit.core import job_environment, submission

    def keep_our_handlers(self: job_environment.JobEnvironment, paths: object, submission: object) -> None:
        return None

    job_environment.JobEnvironment._handle_signals = keep_our_handlers  # type: ignore[method-assign]
    submission.process_job(folder)


def main(argv: list[str]) -> int:
    catch_stop_signals()
    import argparse  # after the signals: nothing before them

    parser = argparse.ArgumentParser(prog="python -m hpc.rank.entry", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", metavar="SUBMITIT_FOLDER", help="the job's submitit folder (as the batch script's srun line gives it)")
    run_submitit_job(parser.parse_args(argv).folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
