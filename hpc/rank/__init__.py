"""What runs on every rank: the entry point (main), binding to GPU/NIC/CPUs, and the lifecycle
after a stop (requeue or exit). Never imports submission code, Hydra or submitit."""
