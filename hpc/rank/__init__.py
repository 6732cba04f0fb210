"""What runs on every rank: the stop signals caught from its first instruction (signals; under
srun, entry runs submitit's job runner), the entry point (main), binding to GPU/NIC/CPUs, and the
lifecycle after a stop (requeue or exit). Never imports submission code or Hydra, and submitit
only in entry, to run the job it pickled."""
