"""The stages of bench/gpu_bench.py, one module each.

A stage module exposes `run(args, **options) -> dict`: it runs in a process of its own and returns
what bench/gpu_bench.py writes to OUT/<stage>.json. It may also expose `add_arguments(parser)` (its
own flags), `report(args, results)` (prints its table from every stage's record) and `REQUIRES`
(stages whose results it reads, run first when OUT lacks them). Registering a module in
gpu_bench.STAGES makes it a stage; `python -m bench.stages.<module> --out DIR` runs its stages alone.
A large stage keeps its parts in modules named after it (linear_sweep.py beside linear.py).
"""
