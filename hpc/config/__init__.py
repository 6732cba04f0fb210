"""Login node: the typed schemas, Hydra composition, and the one validate() of a job."""
