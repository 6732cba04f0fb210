"""The training side: fit loop, models, HDF5 data, metrics. Never imports hydra or submitit."""
