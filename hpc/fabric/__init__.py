"""Node and cluster topology as a pure library: rail-aware rank mapping, switch trees, ring
order, placement, hardware detection from sysfs text, and the allreduce cost model."""
