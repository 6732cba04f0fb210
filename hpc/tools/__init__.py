"""Commands users run beside their jobs (status, report, topology, costmodel). Nothing imports
them; the public names `python -m hpc.status` etc. forward here."""
