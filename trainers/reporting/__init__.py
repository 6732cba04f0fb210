"""Reporting: the reporter on rank 0 (reporter.py: the progress line and the fan-out of every
step's and every moment's record), the metrics sinks (sinks.py: the run dir's steps.jsonl and
metrics.jsonl, TensorBoard, Prometheus; trackers.py: MLflow, W&B, and the registry that opens the
chosen ones), the JSON-lines writer the run-files sink uses (metrics.py), the metric names every
rank agrees on (metricnames.py), and each rank's peak memory (memory.py)."""
