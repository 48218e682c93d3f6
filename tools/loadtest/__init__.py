"""Online load test of the public Generation API, in the manner of vLLM's `bench serve`.

    python -m tools.loadtest --target 127.0.0.1:50051 --num-prompts 200 --request-rate 8

Modules: datasets (what to send), arrivals (when), client (sending and timing over grpc.aio),
metrics (TTFT/TPOT/ITL/E2E statistics, goodput, cache hit rate), report (tables, JSON, plots).
"""
