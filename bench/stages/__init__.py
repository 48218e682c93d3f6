"""Benchmark stages: one module per stage, each runnable alone (`python -m bench.stages.NAME
--out DIR`, writing DIR/NAME.json) and importable by a driver that runs several."""
