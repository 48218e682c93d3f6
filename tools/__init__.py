"""Operator tools that run beside the services: the load-test client and the benchmark scripts."""
