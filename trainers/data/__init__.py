"""Data: HDF5 data sets (datasets.py: finding and checking them; reading.py: batches read raw and
ahead of the step), worker processes (loader.py), the sampler that shards a split over the ranks
(sampler.py), augmentation on the device (augment.py), token data for language models (tokens.py,
positions.py), and the converter (convert.py; `python -m trainers.convert`)."""
