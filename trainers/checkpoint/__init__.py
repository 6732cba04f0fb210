"""Checkpoints: the format (tensorfile.py) and directory layout (layout.py), where they live
(storage.py: a directory or an object store), writing, committing and verifying them
(checkpointer.py), saving in step with training (saving.py), what a run's state is (state.py,
shards.py: each rank's pieces of sharded state), resuming and rolling back (recovery.py), and
weights leaving as safetensors (export.py; `python -m trainers.export`)."""
