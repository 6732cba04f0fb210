"""What runs on every rank to train: by topic, loop/ (the built-in loop), checkpoint/, data/,
reporting/ and tasks/, over the modules they share (task.py, config.py, context.py, handle.py,
boundary.py, ...). Imports run `hpc.rank -> trainers -> collectives`; inside, the loop sits above
the other rooms and nothing but its fit is imported from outside it (docs/layout.md,
tests/unit/test_import_rules.py)."""
