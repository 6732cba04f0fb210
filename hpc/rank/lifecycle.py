"""The exit codes a rank ends with besides 0 and a failure's, as the toolkit's launchers, batch
scripts and verifier read them. What follows a stop is the scheduler's (hpc.rank.scheduler)."""

EXIT_RESUMABLE = 75  # "stopped with a committed checkpoint; start the same run dir again"
EXIT_STALLED = 70  # the watchdog ended the job (EX_SOFTWARE)
