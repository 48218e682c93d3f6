"""The analytic floor every benchmark number is compared with, from a model's config and the rates
the bandwidth stage measures on the same GPU (copy bytes/s, bf16 and FP8 matmul FLOP/s).

A decode step reads the attention and dense weights, the experts its batch touches (per MoE layer
E * (1 - (1 - k/E)^B) of them for B tokens routed uniformly at random, as random weights route),
the norms, the LM head, and the KV of every running sequence; or computes 2 FLOPs per active weight
and token, whichever takes longer. A prompt token costs 2 FLOPs per active weight plus its causal
attention. FP8 linear weights are 1 byte (plus a float32 scale per 128 x 128 block) and multiply at
the FP8 rate. The workload floor admits every request at once: prompts first, then decode step t
(t = 1 .. longest output - 1) runs every request still generating.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

FP8_BLOCK = (128, 128)


def expected_touched(num_tokens: int, experts: int, top_k: int) -> float:
    """Distinct experts that num_tokens uniformly routed tokens select, in expectation."""
    return experts * (1 - (1 - top_k / experts) ** num_tokens) if experts else 0.0


class ModelShape:
    """Weight counts of a Qwen3 / Qwen3-MoE config, split into what every token reads and what
    only the experts it is routed to read."""

    def __init__(self, config: dict, fp8: bool = False) -> None:
        self.config, self.fp8 = config, fp8
        h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
        self.hidden = h
        self.head_dim = config.get("head_dim") or h // heads
        q, kv_width = heads * self.head_dim, kv * self.head_dim
        self.layers = config["num_hidden_layers"]
        self.experts = config.get("num_experts", config.get("num_local_experts", 0))
        self.top_k = config.get("num_experts_per_tok", 0)
        step, mlp_only = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
        self.num_sparse = sum(config.get("model_type") == "qwen3_moe" and self.experts > 0 and i not in mlp_only
                              and (i + 1) % step == 0 for i in range(self.layers))
        self.attention_linear = h * (q + 2 * kv_width) + q * h          # per layer, quantizable
        self.dense_mlp_linear = 3 * h * config["intermediate_size"]
        self.expert_linear = 3 * h * config.get("moe_intermediate_size", 0)
        self.router = self.experts * h
        self.small = 2 * self.head_dim + 2 * h                          # q/k norms, layer norms
        self.lm_head = config["vocab_size"] * h
        self.kv_bytes_per_token = 2 * self.layers * kv_width * 2        # bf16 K and V

    @classmethod
    def from_file(cls, path: pathlib.Path, fp8: bool = False) -> "ModelShape":
        return cls(json.loads(pathlib.Path(path).read_text()), fp8)

    def linear_bytes(self, params: float) -> float:
        return params * (1 + 4 / (FP8_BLOCK[0] * FP8_BLOCK[1])) if self.fp8 else params * 2

    @property
    def shared_linear(self) -> int:
        """Linear weights every token uses: attention and the dense MLPs."""
        return self.layers * self.attention_linear + (self.layers - self.num_sparse) * self.dense_mlp_linear

    def step_bytes(self, num_tokens: int) -> float:
        """Weights a forward over num_tokens tokens reads (KV excluded; the embedding is only gathered)."""
        touched = expected_touched(num_tokens, self.experts, self.top_k)
        linear = self.linear_bytes(self.shared_linear + self.num_sparse * touched * self.expert_linear)
        return linear + 2 * (self.num_sparse * self.router + self.layers * self.small + self.hidden + self.lm_head)

    def active_linear(self) -> int:
        """Linear weights one token multiplies (its k experts, not all of them)."""
        return self.shared_linear + self.num_sparse * (self.top_k * self.expert_linear + self.router)

    def step_flops(self, num_tokens: int) -> tuple[float, float]:
        """(FLOPs at the linear layers' rate, FLOPs at the bf16 rate: the LM head)."""
        return 2 * num_tokens * self.active_linear(), 2 * num_tokens * self.lm_head

    def prefill_flops(self, prompt_len: int) -> float:
        causal_pairs = prompt_len * (prompt_len + 1) / 2
        attention = 4 * self.layers * self.config["num_attention_heads"] * self.head_dim * causal_pairs
        return 2 * prompt_len * self.active_linear() + attention


def decode_step_floor_s(shape: ModelShape, batch: int, kv_tokens: float, rates: dict) -> float:
    """One decode step of `batch` sequences holding kv_tokens tokens of KV between them."""
    memory = (shape.step_bytes(batch) + kv_tokens * shape.kv_bytes_per_token) / rates["copy_bytes_per_s"]
    linear_flops, head_flops = shape.step_flops(batch)
    linear_rate = rates["fp8_flops_per_s"] if shape.fp8 else rates["bf16_flops_per_s"]
    return max(memory, linear_flops / linear_rate + head_flops / rates["bf16_flops_per_s"])


@dataclass(frozen=True)
class Floor:
    decode_s: float
    prefill_s: float
    decode_steps: int

    @property
    def total_s(self) -> float:
        return self.decode_s + self.prefill_s


def workload_floor(prompt_lens: list[int], max_tokens: list[int], shape: ModelShape, rates: dict) -> Floor:
    decode_s, steps = 0.0, 0
    for t in range(1, max(max_tokens)):
        # Requests still generating after t tokens, and their contexts (prompt + t).
        running = [p for p, n in zip(prompt_lens, max_tokens) if n > t]
        decode_s += decode_step_floor_s(shape, len(running), sum(p + t for p in running), rates)
        steps += 1
    prefill_s = sum(shape.prefill_flops(p) for p in prompt_lens) / rates["bf16_flops_per_s"]
    return Floor(decode_s, prefill_s, steps)
