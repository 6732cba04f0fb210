"""The built-in training loop, split by job: fit.py drives it pass after pass; build.py makes it
from the configs; passes.py is the step and its bookkeeping; engine.py the model and what updates
it; dataplan.py the splits, the sampler and the readers; policies.py what the sums of a step call
for (stop, save, rollback, evaluation); records.py the figures a step and a pass leave."""
