"""Login-node and rank-environment side. The submit path never imports torch."""
