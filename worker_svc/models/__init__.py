"""Model architectures the worker runs."""
