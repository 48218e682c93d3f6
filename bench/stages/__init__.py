"""Benchmark stages, each runnable alone (`python -m bench.stages.<stage> --out DIR`) and by the driver."""
