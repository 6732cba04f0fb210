"""Built-in tasks. They use the same seam (trainers.task.Task) as a user's own."""
