"""The resume verifier (`hpc-launch verify=resume ...`): resume.py runs the user's job
uninterrupted and interrupted and says PASS or FAIL; compare.py compares two runs' losses and
final checkpoints bit for bit. Imported only when a verification is asked for (it loads torch
to read checkpoints)."""
