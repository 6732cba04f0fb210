"""Reporting: the per-step reporter on rank 0 (reporter.py: the progress line and the fan-out),
the metrics sinks (sinks.py: steps.jsonl, TensorBoard, Prometheus; trackers.py: MLflow, W&B),
metrics.jsonl (metrics.py), the metric names every rank agrees on (metricnames.py), and each
rank's peak memory (memory.py)."""
