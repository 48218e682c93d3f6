"""Qwen3-MoE's sparse MLP: a router picks each token's top-k experts, each expert (a SwiGLU MLP)
runs on the tokens routed to it, and their outputs are summed with the router's weights.

Routing is transformers' Qwen3MoeTopKRouter exactly: router logits in the model dtype, softmax
over all experts in float32, top-k, renormalised to sum to 1 when `norm_topk_prob`, cast to the
model dtype. Expert weights are stacked: w13 [E, 2 * I, H] (gate rows, then up rows, as the
dense gate_up_proj) and w2 [E, H, I], filled from the Hugging Face per-expert layout
(`mlp.experts.{i}.{gate,up,down}_proj.weight`, see loader.expert_modules_mapping).
Tensor parallelism splits each expert's intermediate dimension as the dense MLP is split (gate
and up rows column-parallel, down's columns row-parallel) and sums the block's output across
ranks; the router is replicated, so every rank routes every token the same way.

Two implementations of the experts:
- `moe_reference`: a plain-torch loop over the experts that received tokens, transformers' own
  order of operations and roundings. The CPU path, and the reference the kernels are tested against.
- worker_svc.layers.moe_kernels (CUDA, or FP8 experts anywhere Triton runs): routing, the sort
  of tokens by expert and grouped GEMMs in Triton, with no host sync and shapes fixed by the
  token count, so a decode step with MoE layers is capturable in a CUDA graph.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker_svc.layers.fp8 import FP8_DTYPE, BlockFp8Tensor, Fp8Config, as_dense, as_fp8, fill_random_fp8_
from worker_svc.parallel_state import divide, get_tp_rank, get_tp_size

# WORKER_FUSED_MOE=0 runs the reference loop on CUDA too (for comparisons); FP8 experts need the kernels.
FUSED_ENABLED = os.environ.get("WORKER_FUSED_MOE", "1") != "0"


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in the logits' dtype, expert ids [tokens, top_k] int64), as
    transformers' Qwen3MoeTopKRouter computes them."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """sum over each token's experts e of weight * w2[e] @ (silu(gate) * up), [gate | up] = w13[e] @ x,
    expert by expert in ascending order, each contribution rounded to x's dtype and added into
    the output, as transformers' Qwen3MoeExperts does. Reads which experts were hit on the host."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        slot, token = torch.where(topk_ids.T == expert)   # transformers' order: by slot, then token
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        hidden = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, hidden.to(out.dtype))
    return out


class FusedExperts(nn.Module):
    """Every expert's projections, stacked: w13_weight [E, 2 * I / tp, H] and w2_weight
    [E, H, I / tp], in FP8 with per-block scales when quantized for the kernels."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 quant: Fp8Config | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts = num_experts
        self.intermediate_per_rank = divide(intermediate_size, self.tp_size)
        self.quant = quant
        fp8 = quant is not None and quant.kernel
        i, h = self.intermediate_per_rank, hidden_size
        shapes = {"w13_weight": (num_experts, 2 * i, h), "w2_weight": (num_experts, h, i)}
        parts = {"w13_weight": ("gate", "up"), "w2_weight": ("down",)}
        if fp8:
            bn, bk = quant.block
            if i % bn or i % bk or h % bk:
                raise ValueError(f"FP8 experts need the intermediate size per rank ({i}) and the hidden size ({h}) "
                                 f"in whole {bn}x{bk} blocks")
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE if fp8 else None), requires_grad=False)
            param.weight_loader = self.weight_loader
            param.shard_ids = tuple((e, part) for e in range(num_experts) for part in parts[name])
            self.register_parameter(name, param)
            if fp8:
                scale = nn.Parameter(torch.empty(num_experts, -(-shape[1] // bn), shape[2] // bk,
                                                 dtype=torch.float32), requires_grad=False)
                scale.shard_ids = ()   # filled with the weight
                self.register_parameter(f"{name}_scale_inv", scale)
                param.init_dummy = lambda generator, std, _name=name: fill_random_fp8_(
                    getattr(self, _name).data, getattr(self, f"{_name}_scale_inv").data, quant.block, generator, std)

    @property
    def is_fp8(self) -> bool:
        return self.w13_weight.dtype == FP8_DTYPE

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | BlockFp8Tensor, shard_id) -> None:
        """One expert's gate_proj/up_proj [I, H] or down_proj [H, I] from the checkpoint."""
        expert, part = shard_id
        split_dim = 1 if part == "down" else 0   # down's input columns, gate's and up's output rows
        offset = self.intermediate_per_rank if part == "up" else 0
        if self.is_fp8:
            if isinstance(loaded, torch.Tensor):
                loaded = loaded.to(param.device)
            shard = as_fp8(loaded, self.quant.block).chunk(self.tp_size, split_dim)[self.tp_rank]
            param.data[expert].narrow(0, offset, shard.shape[0]).copy_(shard.values)
            scale = getattr(self, f"{'w2' if part == 'down' else 'w13'}_weight_scale_inv")
            bn = self.quant.block[0]
            scale.data[expert].narrow(0, offset // bn, shard.scale_inv.shape[0]).copy_(shard.scale_inv)
        else:
            shard = as_dense(loaded, param.dtype, self.quant).chunk(self.tp_size, split_dim)[self.tp_rank]
            param.data[expert].narrow(0, offset, shard.shape[0]).copy_(shard)


class Router(nn.Module):
    """The gate: one logit per expert, in the model dtype (never quantized)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        param.data.copy_(as_dense(loaded, param.dtype, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Qwen3MoeSparseMoeBlock: `mlp.gate` (the router) and `mlp.experts`."""

    def __init__(self, config, quant: Fp8Config | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen3-MoE uses silu, this checkpoint asks for {config.hidden_act!r}")
        self.tp_size = get_tp_size()
        self.top_k = config.num_experts_per_tok
        self.renormalize = bool(config.norm_topk_prob)
        self.gate = Router(config.hidden_size, config.num_experts)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, quant)
        self.fp8_modes = None   # FP8 experts: the activation mode by token count, measured (moe_selection)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        experts = self.experts
        if experts.is_fp8 or (x.is_cuda and FUSED_ENABLED):
            from worker_svc.layers import moe_kernels   # imports Triton

            out = moe_kernels.fused_moe(
                x, router_logits, experts.w13_weight, experts.w2_weight, self.top_k, self.renormalize,
                w13_scale=getattr(experts, "w13_weight_scale_inv", None),
                w2_scale=getattr(experts, "w2_weight_scale_inv", None),
                block=experts.quant.block if experts.is_fp8 else None,
                fp8_activations=self.fp8_modes.mode_for(x.shape[0]) if self.fp8_modes is not None else None,
            )
        else:
            if x.is_cuda and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the reference expert loop reads the routing on the host and cannot be captured "
                                   "in a CUDA graph: with WORKER_FUSED_MOE=0, run with --enforce-eager")
            weights, ids = route(router_logits, self.top_k, self.renormalize)
            out = moe_reference(x, experts.w13_weight, experts.w2_weight, weights, ids)
        if self.tp_size > 1:
            dist.all_reduce(out)
        return out
