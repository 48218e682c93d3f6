"""The benchmark workload (nano-vllm's bench.py) and its analytic floor.

Workload: 256 requests, prompt and output lengths uniform in 100..1024, prompt ids uniform in
0..10000, ignore_eos; drawn with Python's `random` seeded 0 in nano-vllm's order, so the
requests are exactly nano-vllm's.

Floor (analytic, from the workload; not from logged steps): every request is admitted at once
(max_num_seqs >= the request count, and the KV cache holds them all), prompts are computed
first, then decode step t (t = 1 .. longest output - 1) runs every request still generating.
A decode step must read all weights once plus the KV of every running sequence; a prompt token
costs 2 FLOPs per weight plus its causal attention. So
    floor = sum over decode steps (weight bytes + KV bytes of the running sequences) / copy bandwidth
          + prefill FLOPs / matmul rate,
with both rates measured on the same GPU in the same run.
"""
from __future__ import annotations

import json
import pathlib
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def nano_vllm_workload(num_requests: int = 256, min_len: int = 100, max_input_len: int = 1024,
                       max_output_len: int = 1024, seed: int = 0, max_token_id: int = 10000) -> Workload:
    """max_token_id: nano-vllm's 10000; lower only for models with a smaller vocabulary."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(min_len, max_input_len))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(min_len, max_output_len) for _ in range(num_requests)]
    return Workload(prompts, max_tokens)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, path: pathlib.Path) -> "ModelShape":
        c = json.loads(path.read_text())
        return cls(c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                   c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                   c["vocab_size"], c.get("tie_word_embeddings", False))

    @property
    def layer_params(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden + 2 * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return attention + mlp + 2 * self.hidden

    @property
    def weight_bytes_per_step(self) -> int:
        """Weights a forward must read: every layer, the final norm and the LM head (the embedding
        table itself is only gathered, a few rows; untied, it is a separate matrix)."""
        params = self.num_layers * self.layer_params + self.hidden + self.vocab * self.hidden
        return params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def prefill_flops(self, prompt_len: int) -> int:
        dense = 2 * self.num_layers * self.layer_params * prompt_len
        causal_pairs = prompt_len * (prompt_len + 1) // 2
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * causal_pairs
        return dense + attention


@dataclass(frozen=True)
class Floor:
    decode_s: float
    prefill_s: float
    decode_steps: int
    decode_bytes: int

    @property
    def total_s(self) -> float:
        return self.decode_s + self.prefill_s


def workload_floor(workload: Workload, shape: ModelShape, copy_bytes_per_s: float, matmul_flops_per_s: float) -> Floor:
    outputs = sorted(workload.max_tokens)
    prompts = [len(p) for p in workload.prompts]
    total_bytes = 0
    steps = 0
    for t in range(1, outputs[-1]):
        # Requests still generating after t tokens, and their contexts (prompt + t).
        running = [(len(p), n) for p, n in zip(workload.prompts, workload.max_tokens) if n > t]
        total_bytes += shape.weight_bytes_per_step + sum(p + t for p, _ in running) * shape.kv_bytes_per_token
        steps += 1
    prefill = sum(shape.prefill_flops(p) for p in prompts)
    return Floor(total_bytes / copy_bytes_per_s, prefill / matmul_flops_per_s, steps, total_bytes)


def decode_step_floor_s(shape: ModelShape, batch: int, context: int, copy_bytes_per_s: float) -> float:
    """One decode step of `batch` sequences of `context` tokens each."""
    return (shape.weight_bytes_per_step + batch * context * shape.kv_bytes_per_token) / copy_bytes_per_s
