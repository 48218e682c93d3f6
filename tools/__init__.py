"""Operator tools that run beside the services: the CLI client, the load test and soak, the engine in one
process, and launching the services as processes (tools/launch.py) for the tests, the soak and the benchmarks."""
