"""What the scheduler and the workers agree on about speculative decoding: the proposers' names
and the batch size up to which steps speculate by default (scheduler --speculative-max-batch-size,
and the worker's --speculative-graph-batch-size, the steps its proposer's CUDA graphs cover).
Standard library only."""

METHODS = ("ngram", "eagle3", "draft")
# Batches of up to this many requests speculate: bench/stages/spec.py's oracle wins at 8 and loses
# at 64 on the H200 (docs/PERF_NOTES.md v16).
DEFAULT_MAX_BATCH_SIZE = 16
